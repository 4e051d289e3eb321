"""Server-side model modifications: the imprint block and Liu et al.'s partly random head."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.models.malicious import ImprintBlock, RandomFeatureHead, find_module, imprint, random_head


def _model(shape=(3, 8, 8), spec="mlp:16", seed=0):
    return lb.build(spec, input_shape=shape, classes=5, seed=seed)


def test_imprint_ships_a_copy_with_the_block_in_front():
    model = _model()
    before = [p.clone() for p in model.parameters()]
    shipped = imprint(model, bins=10, seed=0)
    assert isinstance(shipped[0], ImprintBlock) and shipped.input_shape == (3, 8, 8)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the user's model is untouched
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(shipped(x), model(x), atol=1e-2)  # small gain: the model sees nearly x


def test_imprint_bins_share_one_unit_query_and_sorted_edges():
    block = imprint(_model(), bins=12, seed=4)[0]
    w = block.linear0.weight
    assert torch.allclose(w, w[:1].expand_as(w))
    assert torch.allclose(block.query.norm(), torch.tensor(1.0))
    assert bool((block.thresholds[1:] > block.thresholds[:-1]).all())
    v = block.linear1.weight
    assert torch.allclose(v, v[:, :1].expand_as(v))  # equal columns: every active bin gets the same gradient


def test_imprint_calibrated_bins_have_equal_mass():
    gen = torch.Generator().manual_seed(1)
    public = torch.rand(4000, 3, 8, 8, generator=gen)
    block = imprint(_model(), bins=8, seed=2, calibration=public)[0]
    def mass(x):
        scores = x.reshape(x.shape[0], -1).double() @ block.query.double()
        bins = (scores[:, None] > block.thresholds.double()[None]).sum(1) - 1
        return torch.bincount(bins, minlength=8).double() / x.shape[0]

    eighth = torch.full((8,), 1 / 8, dtype=torch.float64)
    assert torch.allclose(mass(public), eighth, atol=2 / 4000)  # empirical quantiles of the calibration set
    # fresh samples: the quantile estimates' error (std ≈ 0.007 per bin for 4 000 samples) dominates
    assert torch.allclose(mass(torch.rand(20000, 3, 8, 8, generator=gen)), eighth, atol=0.025)


def test_imprint_masses_come_from_held_out_public_data():
    data = lb.load("digits")
    model = lb.build("mlp:8", input_shape=data.shape, classes=10, seed=0)
    cal, hold, rest = data.images[:100], data.images[100:500], data.images[500:]
    block = imprint(model, bins=16, seed=0, calibration=cal, holdout=hold)[0]
    assert block.masses_source == "holdout" and block.masses.dtype == torch.float64
    assert torch.allclose(block.masses, block.bin_masses(hold)) and float(block.masses.sum()) == pytest.approx(1)
    # edges from 100 samples: masses are unequal, and the held-out estimate tracks the rest of the data
    assert float(block.masses.max() / block.masses.min()) > 1.5
    assert torch.allclose(block.masses, block.bin_masses(rest), atol=0.03)
    # without a holdout the calibration sample's own masses (equal by construction) are reported
    own = imprint(model, bins=16, seed=0, calibration=data)[0]  # a dataset with .images works too
    equal = torch.full((16,), 1 / 16, dtype=torch.float64)
    assert own.masses_source == "calibration" and torch.allclose(own.masses, equal, atol=1 / len(data.images))


def test_imprint_warns_once_without_calibration(monkeypatch):
    from leakbench.models import malicious
    monkeypatch.setattr(malicious, "_WARNED", set())
    with pytest.warns(malicious.UncalibratedImprintWarning, match="calibration=<public images>"):
        block = imprint(_model(), bins=4, seed=0)[0]
    assert block.masses_source.startswith("assumed equal")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        imprint(_model(), bins=4, seed=0)                        # once per process
        imprint(_model(), bins=4, seed=0, mean=1.0, std=2.0)     # an explicit model of the score: no warning


def test_imprint_is_seeded():
    a = imprint(_model(), bins=6, seed=3)[0]
    b = imprint(_model(), bins=6, seed=3)[0]
    c = imprint(_model(), bins=6, seed=4)[0]
    assert torch.equal(a.query, b.query) and not torch.equal(a.query, c.query)


@pytest.mark.parametrize("kwargs,field", [(dict(bins=1), "bins"), (dict(bins=4, query="x"), "query"),
                                          (dict(bins=4, mean=0.0), "mean"),
                                          (dict(bins=4, calibration=torch.zeros(2, 3)), "calibration"),
                                          (dict(bins=4, holdout=torch.zeros(2, 3)), "holdout")])
def test_imprint_bad_input(kwargs, field):
    with pytest.raises(lb.ConfigError, match=field):
        imprint(_model(), **kwargs)


def test_random_head_keeps_the_trained_head_exactly():
    model = _model((3, 16, 16), "cnn:3-4-2-1")
    shipped = random_head(model, width=64, seed=0)
    head = find_module(shipped, RandomFeatureHead)
    assert head is not None and head.random.weight.shape == (64, 4 * 8 * 8)
    x = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    z = x
    for layer in list(model.children())[:-1]:
        z = layer(z)
    extra = head.out(head.act(head.random(z)))
    assert torch.allclose(shipped(x), model(x) + extra, atol=1e-5)
    rows = head.out.weight
    assert torch.allclose(rows, torch.arange(1, 6).float()[:, None].expand(5, 64) / 64)  # A₂[i, :] = i / v


def test_random_head_weights_are_gaussian_and_seeded():
    a = find_module(random_head(_model(), width=500, seed=1), RandomFeatureHead).random.weight
    b = find_module(random_head(_model(), width=500, seed=1), RandomFeatureHead).random.weight
    assert torch.equal(a, b)
    v = a.detach().reshape(-1).double()
    assert abs(float(v.mean())) < 0.05 and abs(float(v.std()) - 1) < 0.05
    assert abs(float(((v - v.mean()) / v.std()).pow(4).mean()) - 3) < 0.3


def test_random_head_needs_a_final_linear_layer():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.Softmax(dim=-1))
    with pytest.raises(lb.ConfigError, match="last nn.Linear"):
        random_head(model, width=8, input_shape=(12,))
    with pytest.raises(lb.ConfigError, match="width"):
        random_head(_model(), width=0)
    with pytest.raises(lb.ConfigError, match="input_shape"):
        random_head(nn.Sequential(nn.Linear(3, 2)), width=4)


def test_random_head_centre_is_the_mean_calibration_feature_and_keeps_the_trained_head():
    model = _model((3, 16, 16), "cnn:3-4-2-1")
    gen = torch.Generator().manual_seed(3)
    public = torch.rand(24, 3, 16, 16, generator=gen)
    shipped = random_head(model, width=64, seed=0, center="calibration", calibration=public, train=False)
    head = find_module(shipped, RandomFeatureHead)
    z = public
    for layer in list(model.children())[:-1]:
        z = layer(z)
    assert torch.allclose(head.center, z.mean(0), atol=1e-5)
    x = torch.rand(3, 3, 16, 16, generator=gen)
    zx = x
    for layer in list(model.children())[:-1]:
        zx = layer(zx)
    extra = head.out(head.act(head.random(zx - head.center)))
    assert torch.allclose(shipped(x), model(x) + extra, atol=1e-5)
    # the features the tensor method sees (the input of ``random``) are centred: their mean is ~0 on the public data
    seen = []
    handle = head.random.register_forward_pre_hook(lambda _m, i: seen.append(i[0].detach()))
    with torch.no_grad():
        shipped.eval()(public)
    handle.remove()
    assert float(seen[0].mean(0).abs().max()) < 1e-5


def test_random_head_noise_centre_is_seeded_and_paper_form_has_none():
    a = find_module(random_head(_model(), width=32, seed=2, center="noise"), RandomFeatureHead).center
    b = find_module(random_head(_model(), width=32, seed=2, center="noise"), RandomFeatureHead).center
    assert a is not None and torch.equal(a, b) and float(a.abs().sum()) > 0
    assert find_module(random_head(_model(), width=32, seed=2), RandomFeatureHead).center is None


@pytest.mark.parametrize("kwargs, field", [(dict(center="mean"), "center"),
                                           (dict(center="calibration"), "calibration"),
                                           (dict(center="calibration", calibration=torch.zeros(4, 3)), "calibration"),
                                           (dict(center="noise", data_range=(1.0, 0.0)), "data_range"),
                                           (dict(center="noise", center_batch=1), "center_batch")])
def test_random_head_bad_centre(kwargs, field):
    with pytest.raises(lb.ConfigError, match=field):
        random_head(_model(), width=8, **kwargs)


# ---------------------------------------------------------------- imprint_text(signature=r): Decepticons
def _text_models():
    import leakbench as lb
    from leakbench.models.malicious import imprint_text

    data = lb.load("text", split="test", context=16)
    honest = lb.build("gpt:layers=2,width=64,heads=4", input_shape=data.shape, classes=data.vocab_size, seed=0)
    public = lb.load("text", split="train", context=16).ids[:200, :16]
    return data, honest, public, imprint_text(honest, bins=512, seed=3, public=public, signature=8)


def test_imprint_text_signature_sets_block_one_and_reserves_dimensions():
    data, honest, public, shipped = _text_models()
    R = torch.arange(56, 64)
    assert honest.blocks[0].mid is None and honest.tok.weight[:, R].abs().sum() > 0  # the caller's model untouched
    block = shipped.blocks[0].mid
    assert shipped.pre is None and torch.equal(block.reserved.cpu(), R)
    assert not shipped.tok.weight[:, R].any() and not shipped.pos.weight[:, R].any()
    qkv = shipped.blocks[0].attn.qkv
    assert not qkv.weight[:128].any() and not qkv.bias.any()         # Q = K = 0: uniform attention
    assert not shipped.blocks[0].attn.proj.weight[:56].any()         # writes into R only
    # bin 0 fires for every public position, and the edges at quantiles spread them over the bins (identical
    # vectors — a common first token — share one bin, so the masses are not all equal)
    with torch.no_grad():
        h = shipped.attended(public)
    seen = h[public != 0]
    assert bool((seen @ block.query > block.thresholds[0]).all())
    masses = block.bin_masses(seen)
    assert float((masses > 0).double().mean()) > 0.9 and float(masses.median()) == pytest.approx(1 / 512, rel=0.5)


def test_imprint_text_signature_is_the_prefix_mean_of_each_tokens_value():
    # an independent computation of equation (2): h¹_t = h⁰_t + (1/(t+1)) Σ_{j≤t} W_o LN₁(h⁰_j)
    data, _, _, shipped = _text_models()
    x, _ = data.batch(3, seed=4)
    with torch.no_grad():
        h0 = shipped.tok(x) + shipped.pos.weight[:16]
        blk = shipped.blocks[0]
        xj = blk.attn.proj(torch.nn.functional.linear(blk.ln1(h0), blk.attn.qkv.weight[128:], blk.attn.qkv.bias[128:]))
        expect = h0.clone()
        for t in range(16):
            expect[:, t] += xj[:, : t + 1].mean(1)
        got = shipped.attended(x)
    assert float((got - expect).abs().max()) < 1e-5
    assert float((got[:, :, :56] - h0[:, :, :56]).abs().max()) == 0.0  # the kept dimensions carry h⁰ unchanged


def test_imprint_text_signature_changes_the_model_and_is_seeded():
    from leakbench.models.malicious import imprint_text

    data, honest, public, shipped = _text_models()
    x, _ = data.batch(2, seed=0)
    with torch.no_grad():
        assert float((shipped(x) - honest(x)).abs().max()) > 1e-2      # a different model: the threat model
    again = imprint_text(honest, bins=512, seed=3, public=public, signature=8)
    other = imprint_text(honest, bins=512, seed=4, public=public, signature=8)
    assert torch.equal(again.blocks[0].attn.proj.weight, shipped.blocks[0].attn.proj.weight)
    assert not torch.equal(other.blocks[0].attn.proj.weight, shipped.blocks[0].attn.proj.weight)
    with pytest.raises(lb.ConfigError, match="argument signature"):
        imprint_text(honest, signature=33)
    with pytest.raises(lb.ConfigError, match="argument signature"):
        imprint_text(honest, signature=True)
