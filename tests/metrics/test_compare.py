"""leakbench.metrics.compare: matched batch scores, labels, duck typing, LPIPS fallback."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from leakbench.errors import ConfigError
from leakbench.metrics import compare, lpips_available, mse, psnr, ssim
from leakbench.metrics import perceptual


def _batch(b=6, shape=(3, 16, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand((b, *shape), generator=g)
    y = torch.randint(0, 10, (b,), generator=g)
    shuffle = torch.randperm(b, generator=g)
    return x, y, shuffle


def _plain(value) -> bool:
    """True when value is made only of JSON-native Python types."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or type(value) in (bool, int, float, str)


def test_perfect_shuffled_reconstruction():
    x, y, shuffle = _batch()
    rec = SimpleNamespace(images=x[shuffle].clone(), labels=y[shuffle].clone())
    s = compare(rec, x, y)
    assert s["mse"] == 0.0 and s["rmse"] == 0.0
    assert s["psnr"] == pytest.approx(200.0)
    assert s["ssim"] == pytest.approx(1.0)
    assert s["label_acc"] == 1.0 and s["label_count_acc"] == 1.0
    assert [shuffle[i].item() for i in s["order"]] == list(range(6))
    assert s["lpips"] is None and "lpips_missing" not in s


def test_label_acc_follows_the_matching():
    x, y, shuffle = _batch(b=8, seed=1)
    y = torch.arange(8)  # distinct labels, so a wrong pairing shows
    noisy = x[shuffle] + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    rec = SimpleNamespace(images=noisy, labels=y[shuffle])
    assert compare(rec, x, y)["label_acc"] == 1.0
    unmatched = compare(rec, x, y, match=False)
    assert unmatched["label_acc"] == pytest.approx((shuffle == torch.arange(8)).double().mean().item())
    assert unmatched["label_acc"] < 1.0
    # the multiset of labels is right whatever the pairing
    assert unmatched["label_count_acc"] == 1.0
    assert unmatched["order"] == list(range(8))
    assert unmatched["mse"] > compare(rec, x, y)["mse"]


def test_label_count_acc_is_multiset_intersection():
    x, _, _ = _batch(b=4, seed=3)
    y = torch.tensor([0, 0, 1, 2])
    rec = SimpleNamespace(images=torch.rand(4, 3, 16, 16), labels=torch.tensor([1, 0, 3, 1]))
    s = compare(rec, x, y)
    assert s["label_count_acc"] == pytest.approx(2 / 4)  # {0, 1} shared, the second 1 and the 3 are not
    per = s["per_sample"]["label_acc"]
    assert s["label_acc"] == pytest.approx(sum(per) / 4)


def test_soft_labels_use_argmax():
    x, y, shuffle = _batch(b=5, seed=4)
    scores = torch.nn.functional.one_hot(y[shuffle], 10).float() * 3 + 0.1 * torch.rand(5, 10)
    s = compare(SimpleNamespace(images=x[shuffle], labels=scores), x, y)
    assert s["label_acc"] == 1.0


def test_duck_typed_object_without_labels_and_plain_tensor():
    x, y, shuffle = _batch(seed=5)

    class Rec:  # has images only
        def __init__(self, images):
            self.images = images

    s = compare(Rec(x[shuffle]), x, y)
    assert s["label_acc"] is None and s["label_count_acc"] is None
    assert s["mse"] == 0.0
    t = compare(x[shuffle], x, y)
    assert t["order"] == s["order"] and t["label_acc"] is None
    no_y = compare(SimpleNamespace(images=x, labels=y), x)
    assert no_y["label_acc"] is None


def test_per_sample_values_are_scores_of_matched_pairs():
    x, _, shuffle = _batch(b=5, seed=6)
    rec = (x[shuffle] + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(7))).clamp(0, 1)
    s = compare(rec, x)
    matched = rec[s["order"]]
    assert s["per_sample"]["mse"] == pytest.approx(mse(matched, x).tolist(), rel=1e-12)
    assert s["per_sample"]["psnr"] == pytest.approx(psnr(matched, x).tolist(), rel=1e-12)
    assert s["per_sample"]["ssim"] == pytest.approx(ssim(matched, x).tolist(), rel=1e-12)
    assert s["mse"] == pytest.approx(sum(s["per_sample"]["mse"]) / 5)
    assert s["psnr"] == pytest.approx(sum(s["per_sample"]["psnr"]) / 5)
    assert s["rmse"] == pytest.approx(math.sqrt(s["mse"]))
    assert s["per_sample"]["rmse"] == pytest.approx([math.sqrt(v) for v in s["per_sample"]["mse"]])
    assert sorted(s["per_sample"]) == ["chance_rmse", "cosine", "mse", "psnr", "psnr_registered", "rmse", "ssim"]  # every registered metric


def test_non_image_data_has_no_ssim():
    x = torch.rand(4, 30)
    s = compare(x.flip(0), x, lpips=True)
    assert s["ssim"] is None and "ssim" not in s["per_sample"]
    assert s["mse"] == 0.0 and s["order"] == [3, 2, 1, 0]
    assert s["lpips"] is None and isinstance(s["lpips_missing"], str)


def test_more_reconstructions_than_originals():
    x, y, _ = _batch(b=3, seed=8)
    extra = torch.rand(4, 3, 16, 16)
    images = torch.cat([extra[:2], x[2:], x[:2], extra[2:]])  # x[2], x[0], x[1] at 2, 3, 4
    labels = torch.cat([torch.tensor([9, 9]), y[2:], y[:2], torch.tensor([9, 9])])
    s = compare(SimpleNamespace(images=images, labels=labels), x, y)
    assert s["order"] == [3, 4, 2] and s["mse"] == 0.0 and s["label_acc"] == 1.0
    with pytest.raises(ConfigError, match="match=True"):
        compare(images, x, match=False)


def test_shape_mismatch_message():
    x = torch.rand(2, 3, 16, 16)
    with pytest.raises(ConfigError) as info:
        compare(torch.rand(2, 1, 16, 16), x)
    assert "(2, 1, 16, 16)" in str(info.value) and "(2, 3, 16, 16)" in str(info.value)
    with pytest.raises(ConfigError, match="images"):
        compare("not a tensor", x)
    with pytest.raises(ConfigError, match=r"field y"):
        compare(SimpleNamespace(images=x, labels=torch.tensor([0, 1])), x, torch.tensor([0, 1, 2]))


def test_result_is_json_serialisable():
    x, y, shuffle = _batch(seed=9)
    rec = SimpleNamespace(images=x[shuffle] * 0.9, labels=y[shuffle])
    s = compare(rec, x, y, lpips=True)
    assert _plain(s)
    back = json.loads(json.dumps(s, allow_nan=False))
    assert back == s


def _lpips_installed_here() -> bool:
    """Independently of lpips_available: the package with its weights, torchvision, and AlexNet in the hub cache."""
    import importlib.util

    spec = importlib.util.find_spec("lpips")
    if spec is None or importlib.util.find_spec("torchvision") is None:
        return False
    weights = Path(spec.origin).parent / "weights" / "v0.1" / "alex.pth"
    return weights.is_file() and any((Path(torch.hub.get_dir()) / "checkpoints").glob("alexnet-*.pth"))


def test_lpips_state_is_reported_as_it_is_here():
    """Whatever this machine has: the reported state matches what is installed, and a missing LPIPS is
    reported in the result, never raised."""
    ok, reason = lpips_available()
    assert ok == _lpips_installed_here(), reason
    x, _, _ = _batch(b=2, shape=(3, 32, 32))
    s = compare(x, x, lpips=True)
    if ok:
        assert reason == "" and "lpips_missing" not in s and s["lpips"] == pytest.approx(0.0, abs=1e-6)
    else:
        assert "LPIPS unavailable" in reason and ("pip install" in reason or "torch hub cache" in reason)
        assert s["lpips"] is None and s["lpips_missing"] == reason
        with pytest.raises(ConfigError, match="LPIPS unavailable"):
            perceptual.lpips_distance(x, x)


@pytest.fixture
def fake_lpips(tmp_path, monkeypatch):
    """A stand-in ``lpips`` package plus the weight files LPIPS needs, all on a temporary path."""
    pkg = tmp_path / "site" / "lpips"
    (pkg / "weights" / "v0.1").mkdir(parents=True)
    (pkg / "weights" / "v0.1" / "alex.pth").write_bytes(b"")
    (pkg / "__init__.py").write_text(
        "import torch\n"
        "class LPIPS(torch.nn.Module):\n"
        "    calls = []\n"
        "    def __init__(self, net='alex', pretrained=True, verbose=True):\n"
        "        super().__init__()\n"
        "    def forward(self, a, b, normalize=False):\n"
        "        LPIPS.calls.append((tuple(a.shape), float(a.min()), normalize))\n"
        "        if normalize:\n"
        "            a, b = 2 * a - 1, 2 * b - 1\n"
        "        return (a - b).abs().mean(dim=(1, 2, 3), keepdim=True)\n"
    )
    tv = tmp_path / "site" / "torchvision"
    tv.mkdir()
    (tv / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    perceptual._model.cache_clear()
    yield tmp_path
    perceptual._model.cache_clear()
    sys.modules.pop("lpips", None)


def test_lpips_availability_checks_every_file(fake_lpips):
    ok, reason = lpips_available()
    assert not ok and "alexnet-owt-7be5be79.pth" in reason and str(fake_lpips / "torch") in reason
    checkpoints = fake_lpips / "torch" / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "alexnet-owt-7be5be79.pth").write_bytes(b"")
    assert lpips_available() == (True, "")
    (fake_lpips / "site" / "lpips" / "weights" / "v0.1" / "alex.pth").unlink()
    ok, reason = lpips_available()
    assert not ok and "alex.pth" in reason


def test_compare_uses_lpips_on_matched_pairs_when_available(fake_lpips):
    checkpoints = fake_lpips / "torch" / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "alexnet-owt-7be5be79.pth").write_bytes(b"")
    x, _, shuffle = _batch(b=3, shape=(1, 32, 32), seed=10)
    rec = x[shuffle] + 0.1
    s = compare(rec, x, lpips=True)
    assert "lpips_missing" not in s
    matched = rec[s["order"]]
    want = (2 * (matched - x)).abs().flatten(1).mean(1)  # the stand-in's distance on [-1, 1] inputs
    assert s["per_sample"]["lpips"] == pytest.approx(want.tolist(), rel=1e-6)
    assert s["lpips"] == pytest.approx(want.mean().item(), rel=1e-6)
    import lpips

    shape, _, normalize = lpips.LPIPS.calls[-1]
    assert shape == (3, 3, 32, 32) and normalize is True  # grayscale repeated to RGB
    small = compare(x[:, :, :8, :8], x[:, :, :8, :8], lpips=True)
    assert small["lpips"] is None and "31×31" in small["lpips_missing"]


# --------------------------------------------------------------------------- matching that respects exact flags
def _exact_pair():
    g = torch.Generator().manual_seed(4)
    x = torch.rand(2, 3, 8, 8, generator=g, dtype=torch.float64)
    images = torch.stack([x[0], 2 * x[0] - x[1]])  # slot 0 exact; slot 1 nearer x[0] than x[1]
    return x, images


def test_compare_scores_a_flagged_exact_slot_against_its_own_original():
    x, images = _exact_pair()
    plain = compare(images, x)
    assert plain["matching"] == "total-mse" and plain["order"] == [1, 0]  # eq. (1) gives the exact slot x[1]
    assert min(plain["per_sample"]["mse"]) > 0.01
    rec = SimpleNamespace(images=images, confidence=torch.tensor([1.0, 0.0]))
    flagged = compare(rec, x)  # "auto": the attack flags slot 0 exact
    assert flagged["matching"] == "confident-first" and flagged["order"] == [0, 1]
    assert flagged["per_sample"]["mse"][0] == 0.0 and flagged["psnr"] > plain["psnr"]
    assert compare(rec, x, matching="total-mse")["order"] == [1, 0]  # eq. (1) stays available
    assert compare(rec, x, matching="minmax")["matching"] == "minmax"
    assert compare(rec, x, match=False)["matching"] == "identity"


def test_graded_confidence_is_not_a_flag():
    x, images = _exact_pair()
    rec = SimpleNamespace(images=images, confidence=torch.tensor([0.9, 0.3]))  # scores, not 0/1 flags
    assert compare(rec, x)["matching"] == "total-mse"
    with pytest.raises(ConfigError, match="matching"):
        compare(rec, x, matching="confident-first")
    with pytest.raises(ConfigError, match="matching"):
        compare(images, x, matching="nearest")


def test_exclusivity_flags_are_scored_exactly():
    """Pan et al.'s uniqueness flags drive the matching: every flagged slot scores its own original, exactly."""
    import leakbench as lb

    data = lb.load("digits", size=28)
    x, y = data.batch(8, seed=3)
    x = x.double()
    model = lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=1, dtype=torch.float64)
    rec = lb.attack("exclusivity", lb.observe(model, x, y))
    s = compare(rec, x, y)
    flagged = [i for i, u in enumerate(rec.trace["unique"]) if u]
    assert s["matching"] == "confident-first" and len(flagged) >= 4
    for i, slot in enumerate(s["order"]):
        if slot in flagged:
            assert s["per_sample"]["mse"][i] < 1e-20


def test_compare_returns_the_chance_level_of_a_flat_image():
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(3, 1, 6, 6, generator=gen)
    rec = torch.rand(3, 1, 6, 6, generator=gen)
    out = compare(rec, x)
    grey = x.double().mean()  # default level: the batch's mean pixel value
    mse = ((x.double() - grey) ** 2).mean().item()
    assert abs(out["chance_rmse"] - mse ** 0.5) < 1e-12
    assert abs(out["chance_psnr"] - 10 * np.log10(1 / mse)) < 1e-9
    each = ((x.double() - grey) ** 2).flatten(1).mean(1).sqrt().tolist()
    assert np.allclose(out["per_sample"]["chance_rmse"], each)
    at = compare(rec, x, chance_level=0.25)  # a sweep passes the dataset's mean
    assert abs(at["chance_rmse"] - ((x.double() - 0.25) ** 2).mean().sqrt().item()) < 1e-12
    flat = torch.full_like(x, 0.25)
    assert abs(compare(flat, x, chance_level=0.25)["rmse"] - at["chance_rmse"]) < 1e-6  # a flat image scores chance
