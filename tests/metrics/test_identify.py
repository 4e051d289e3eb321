"""leakbench.metrics.identify: IIP against brute force, its chance level, registered PSNR; both in compare."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from leakbench.errors import ConfigError
from leakbench.metrics import METRICS, SCORES, compare, psnr
from leakbench.metrics.identify import (iip, iip_chance, penultimate_features, psnr_registered, random_features,
                                        registered_shift)


def _data(b=5, p=40, shape=(1, 6, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    others = torch.rand((p, *shape), generator=g)
    x = torch.rand((b, *shape), generator=g)
    pool = torch.cat([others[: p // 2], x, others[p // 2:]])
    return x, pool, g


def _brute(rec, x, pool):
    r, o, q = (t.numpy().reshape(t.shape[0], -1) for t in (rec, x, pool))
    out = []
    for i in range(r.shape[0]):
        d = [float(np.sum((r[i] - q[j]) ** 2)) for j in range(q.shape[0])]
        out.append(bool(np.array_equal(q[int(np.argmin(d))], o[i])))
    return out


def test_iip_matches_brute_force():
    x, pool, g = _data()
    # mixed: some near their original, some near another pool image, one pure noise
    rec = torch.stack([x[0] + 0.01, pool[3] + 0.01, x[2] + 0.3 * torch.rand(x[2].shape, generator=g),
                       torch.rand(x[3].shape, generator=g), x[4]])
    got = iip(rec, x, pool)
    want = _brute(rec, x, pool)
    assert got.identified.tolist() == want
    assert got.rate == pytest.approx(sum(want) / len(want))
    assert got.identified[0] and not got.identified[1] and got.identified[4]


def test_iip_feature_space_and_chance():
    x, pool, _ = _data()
    fn = random_features(x.shape[1:], dim=64, seed=1)
    assert iip(x, x, pool, space="features", feature_fn=fn).rate == 1.0
    assert torch.equal(fn(x), random_features(x.shape[1:], dim=64, seed=1)(x))  # seeded
    chance = iip_chance(x, pool, float(pool.mean()))
    assert chance <= 1 / x.shape[0]
    # the flat image equal to an original's pool entry: identifies exactly that one
    x2 = torch.cat([torch.full_like(x[:1], 0.5), x[1:]])
    pool2 = torch.cat([pool, x2[:1]])
    assert iip_chance(x2, pool2, 0.5) == pytest.approx(1 / x.shape[0])


def test_iip_refusals():
    x, pool, _ = _data()
    with pytest.raises(ConfigError, match="field pool"):
        iip(x, x, pool[:3])
    with pytest.raises(ConfigError, match="field space"):
        iip(x, x, pool, space="lab")
    with pytest.raises(ConfigError, match="field feature_fn"):
        iip(x, x, pool, space="features")


def test_psnr_registered_shift_zero_and_known_shift():
    g = torch.Generator().manual_seed(3)
    x = torch.rand((4, 3, 10, 10), generator=g)
    rec = (x + 0.05 * torch.rand(x.shape, generator=g)).clamp(0, 1)
    assert torch.allclose(psnr_registered(rec, x, max_shift=0), psnr(rec, x))
    shifted = torch.roll(x, (1, -2), dims=(2, 3))
    assert registered_shift(shifted, x).tolist() == [[-1, 2]] * 4
    assert torch.allclose(psnr_registered(shifted, x), psnr(x, x))  # recovered exactly: the 200 dB cap
    assert (psnr_registered(shifted, x) > psnr(shifted, x) + 50).all()
    with pytest.raises(ConfigError, match="field max_shift"):
        psnr_registered(rec, x, max_shift=-1)


def test_compare_reports_iip_and_registered_psnr_with_chances():
    x, pool, _ = _data(shape=(1, 8, 8))
    scores = compare(torch.roll(x, 1, dims=3), x, match=False, pool=pool, chance_level=0.5,
                     feature_fn=random_features(x.shape[1:], seed=0))
    for key in ("iip_pixel", "chance_iip_pixel", "iip_features", "chance_iip_features", "psnr_registered",
                "chance_psnr_registered"):
        assert isinstance(scores[key], float), key
    assert scores["psnr_registered"] > 100 > scores["psnr"]
    assert scores["chance_psnr_registered"] < 20
    assert len(scores["per_sample"]["iip_pixel"]) == x.shape[0]
    assert "psnr_registered" in METRICS and SCORES["iip_pixel"].higher_is_better
    plain = compare(x, x)
    assert "iip_pixel" not in plain and plain["psnr_registered"] > 100


def test_penultimate_features_are_the_last_linear_input_and_leave_the_model_as_it_was():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 7), torch.nn.BatchNorm1d(7),
                                torch.nn.ReLU(), torch.nn.Linear(7, 3))
    x, pool, _ = _data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fn = penultimate_features(model)
    model.eval()
    want = model[:4](x)
    model.train()
    assert torch.allclose(fn(x), want) and model.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # BN statistics untouched
    assert iip(x, x, pool, space="features", feature_fn=fn).rate == 1.0
    with pytest.raises(ConfigError, match="field model"):
        penultimate_features(torch.nn.Conv2d(1, 1, 1))
