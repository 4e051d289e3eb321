"""Defenses on the shared gradient: each one's defining property, composition order, bad specs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import leakbench as lb
from leakbench.defenses import (
    Clip,
    Composition,
    GradDrop,
    Noise,
    Prune,
    Quantize,
    parse,
)
from leakbench.defenses.gradient import clip, global_norm, prune, pruned_count
from leakbench.errors import ConfigError


def _grads(seed=0, shapes=((40, 30), (30,), (7, 3, 5, 5), (1,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * (i + 1) for i, s in enumerate(shapes)]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _nnz(grads):
    return sum(int((g != 0).sum()) for g in grads)


def _n(grads):
    return sum(g.numel() for g in grads)


@pytest.mark.parametrize("p", [0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 0.999, 1.0])
def test_global_prune_keeps_exactly_the_largest_entries(p):
    grads = _grads()
    out = parse(f"prune:{p}").apply_gradients(grads, generator=_gen())
    n = _n(grads)
    assert _nnz(out) == n - math.floor(p * n + 1e-9)
    flat_in = torch.cat([g.reshape(-1) for g in grads])
    flat_out = torch.cat([g.reshape(-1) for g in out])
    kept = flat_out != 0
    # kept entries are unchanged; every kept magnitude ≥ every pruned one (the smallest are gone)
    assert torch.equal(flat_out[kept], flat_in[kept])
    if kept.any() and (~kept).any():
        assert float(flat_in[kept].abs().min()) >= float(flat_in[~kept].abs().max())
    assert [o.shape for o in out] == [g.shape for g in grads]


@pytest.mark.parametrize("p", [0.25, 0.5, 0.9])
def test_layer_prune_keeps_the_count_in_every_tensor(p):
    grads = _grads(1)
    out = parse(f"prune:{p},layer").apply_gradients(grads, generator=_gen())
    for g, o in zip(grads, out):
        assert int((o != 0).sum()) == g.numel() - pruned_count(p, g.numel())
        kept = o != 0
        if kept.any() and (~kept).any():
            assert float(g[kept].abs().min()) >= float(g[~kept].abs().max())
    # global and per-layer differ when tensors have different scales
    glob = prune(grads, p)
    assert not all(torch.equal(a, b) for a, b in zip(glob, out))
    # the largest tensor (×4 scale) keeps more than its share under global pruning
    assert int((glob[2] != 0).sum()) > int((out[2] != 0).sum())


def test_pruned_count_is_floor_and_robust_to_float_error():
    assert pruned_count(0.3, 10) == 3 and pruned_count(0.7, 10) == 7 and pruned_count(0.29, 100) == 29
    assert pruned_count(0.999, 10) == 9 and pruned_count(1.0, 5) == 5 and pruned_count(0.0, 5) == 0


@pytest.mark.parametrize("C", [0.5, 2.0, 1e3])
def test_clip_bounds_the_norm_and_keeps_the_direction(C):
    grads = _grads()
    norm = float(global_norm(grads))
    out = parse(f"clip:{C}").apply_gradients(grads, generator=_gen())
    new = float(global_norm(out))
    assert new <= C * (1 + 1e-6)
    if norm > C:
        assert new == pytest.approx(C, rel=1e-6)
    else:
        assert all(torch.equal(a, b) for a, b in zip(out, grads))
    scale = min(1.0, C / norm)
    assert all(torch.allclose(o, g * scale, rtol=1e-6) for o, g in zip(out, grads))


def test_clip_of_a_zero_gradient_is_zero():
    out = clip([torch.zeros(3), torch.zeros(2, 2)], 1.0)
    assert all(torch.equal(o, torch.zeros_like(o)) for o in out)
    zero, ones = clip([torch.zeros(3), torch.ones(2)], 1.0, scope="layer")
    assert torch.equal(zero, torch.zeros(3)) and float(ones.norm()) == pytest.approx(1.0)


@pytest.mark.parametrize("C", [0.5, 5.0, 40.0, 1e3])
def test_layer_clip_bounds_every_tensor_on_its_own(C):
    grads = _grads()  # tensor norms ≈ 35, 14, 71, 1.6: C = 5 and 40 clip some tensors and not others
    out = parse(f"clip:{C},layer").apply_gradients(grads, generator=_gen())
    assert [o.shape for o in out] == [g.shape for g in grads]
    for g, o in zip(grads, out):
        a = g.double().numpy().reshape(-1)  # independent computation: numpy, float64
        norm = float(np.sqrt((a * a).sum()))
        expected = a * min(1.0, C / norm)
        assert np.allclose(o.double().numpy().reshape(-1), expected, rtol=1e-6, atol=1e-12)
        assert float(np.linalg.norm(o.double().numpy())) == pytest.approx(min(norm, C), rel=1e-6)
        if norm <= C:
            assert torch.equal(o, g)  # tensors under the bound pass unchanged
    if C == 5.0:  # the whole gradient clipped to 5 would shrink every tensor by the same factor; per tensor not
        glob = clip(grads, C)
        assert float(global_norm(glob)) == pytest.approx(C, rel=1e-6)
        assert float(global_norm(out)) > C
        ratios = [float(o.norm() / g.norm()) for o, g in zip(out, grads)]
        assert max(ratios) / min(ratios) > 2


def test_layer_clip_keeps_every_per_tensor_cosine():
    grads = _grads(2)
    out = clip(grads, 1.0, scope="layer")
    for g, o in zip(grads, out):
        assert float(torch.nn.functional.cosine_similarity(g.reshape(1, -1), o.reshape(1, -1))) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="expected scope in"):
        clip(grads, 1.0, scope="tensor")


@pytest.mark.parametrize("sigma", [0.01, 0.5])
def test_noise_has_the_requested_std_and_is_seeded(sigma):
    grads = _grads(shapes=((200, 100), (50,)))
    out = parse(f"noise:{sigma}")(grads, seed=3)
    diff = torch.cat([(o - g).reshape(-1) for o, g in zip(out, grads)])
    # 20 050 draws: the sample std is within 2 % of σ with overwhelming probability
    assert float(diff.std()) == pytest.approx(sigma, rel=0.02)
    assert abs(float(diff.mean())) < 4 * sigma / math.sqrt(diff.numel())
    again = parse(f"noise:{sigma}")(grads, seed=3)
    other = parse(f"noise:{sigma}")(grads, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(out, again))
    assert not all(torch.equal(a, b) for a, b in zip(out, other))
    assert all(torch.equal(a, b) for a, b in zip(parse("noise:0")(grads), grads))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_graddrop_zeroes_entries_at_rate_p(p):
    grads = [torch.randn(300, 100, generator=_gen(1)) + 5.0]  # no exact zeros to begin with
    out = parse(f"graddrop:{p}")(grads, seed=0)[0]
    n = out.numel()
    rate = float((out == 0).float().mean())
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n)
    kept = out != 0
    assert torch.equal(out[kept], grads[0][kept])  # survivors are not rescaled
    # independent across entries: rows have binomial drop counts, not all equal
    assert (out == 0).sum(1).float().std() > 0


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_puts_each_tensor_on_its_grid(bits):
    grads = _grads()
    out = parse(f"quantize:{bits}")(grads)
    levels = 2 ** (bits - 1) - 1
    for g, q in zip(grads, out):
        step = float(g.abs().max()) / levels
        k = q / step
        assert torch.allclose(k, k.round(), atol=1e-4)  # on the grid
        assert int(torch.unique(k.round()).numel()) <= 2 * levels + 1
        assert float((q - g).abs().max()) <= step / 2 * (1 + 1e-5)  # nearest grid point
    fine = parse("quantize:16")(grads)
    coarse = parse("quantize:2")(grads)
    err = lambda qs: sum(float((q - g).pow(2).sum()) for q, g in zip(qs, grads))  # noqa: E731
    assert err(fine) < err(out) <= err(coarse)


def test_stochastic_quantize_is_unbiased():
    g = torch.linspace(-1, 1, 101)
    draws = torch.stack([parse("quantize:2,true")([g], seed=s)[0] for s in range(400)])
    assert set(torch.unique(draws).tolist()) <= {-1.0, 0.0, 1.0}
    assert torch.allclose(draws.mean(0), g, atol=0.12)


def test_composition_order_matters_and_equals_sequential_application():
    grads = _grads()
    a = parse("clip:1+noise:0.5")
    b = parse("noise:0.5+clip:1")
    assert isinstance(a, Composition) and [type(p) for p in a.parts] == [Clip, Noise]
    out_a, out_b = a(grads, seed=0), b(grads, seed=0)
    seq_a = Noise(0.5)(Clip(1.0)(grads), seed=0)
    seq_b = Clip(1.0)(Noise(0.5)(grads, seed=0))
    assert all(torch.equal(x, y) for x, y in zip(out_a, seq_a))
    assert all(torch.equal(x, y) for x, y in zip(out_b, seq_b))
    assert float(global_norm(out_b)) <= 1 + 1e-6  # clipped last: bounded
    assert float(global_norm(out_a)) > 5  # noise last: 20 000 entries of std 0.5 dominate
    c = parse("prune:0.9+graddrop:0.5")(grads, seed=1)
    assert _nnz(c) < _n(grads) * 0.1  # graddrop after prune only removes more


def test_defenses_round_trip_through_their_spec():
    for spec in ["prune:0.9", "prune:0.5,layer", "clip:4", "noise:0.01", "graddrop:0.3", "quantize:4",
                 "quantize:8,true", "clip:4+noise:0.01", "noise:1e-05", "clip:0.123456789", "clip:4,layer",
                 "clip:2,layer+noise:0.01"]:
        d = parse(spec)
        assert d.spec == spec
        assert parse(d.spec).spec == spec
    assert parse("prune:0.9,global").spec == "prune:0.9"
    assert parse("clip:4,global").spec == "clip:4" and parse("clip:4,layer").scope == "layer"
    assert parse("quantize").spec == "quantize"  # default 8 bits
    assert isinstance(parse("prune:0.9"), Prune) and isinstance(parse("graddrop:0.1"), GradDrop)
    assert isinstance(parse("quantize:3"), Quantize) and parse("quantize:3").bits == 3


@pytest.mark.parametrize("spec,match", [
    ("prune:1.5", (r"expected the pruned fraction p in \[0, 1\] for defense 'prune', got 1.5 "
                   r"\(defense spec 'prune:1.5'\)")),
    ("prune:-0.1", "expected the pruned fraction p in"),
    ("prune:0.5,blocks", r"expected scope in \('global', 'layer'\) for defense 'prune', got 'blocks'"),
    ("prune", "defense 'prune' needs p"),
    ("clip:0", "expected the norm bound C > 0 for defense 'clip', got 0.0"),
    ("clip:-1", "expected the norm bound C > 0"),
    ("clip:inf", "expected the norm bound C > 0"),
    ("clip:big", "expected a number for C of defense 'clip', got 'big'"),
    ("noise:-0.1", "expected the noise std σ ≥ 0 for defense 'noise'"),
    ("noise:nan", "expected the noise std σ ≥ 0"),
    ("graddrop:2", r"expected the drop probability p in \[0, 1\] for defense 'graddrop'"),
    ("quantize:1", "expected bits an integer in 2..32 for defense 'quantize', got 1"),
    ("quantize:4.5", "expected a number for bits"),
    ("quantize:4,maybe", "expected true or false for stochastic"),
    ("clip:1,2", r"expected scope in \('global', 'layer'\) for defense 'clip', got '2'"),
    ("clip:1,layer,3", "defense 'clip' takes C,scope, got '1,layer,3'"),
    ("clop:1", "unknown defense 'clop'. Did you mean 'clip'?"),
])
def test_bad_specs_name_the_field_and_the_fix(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse(spec)


def test_shared_defenses_inside_observe_act_on_the_gradient():
    data = lb.load("digits")
    model = lb.build("mlp:16", input_shape=data.shape, classes=10, seed=0)
    x, y = data.batch(4, seed=0)
    clean = lb.observe(model, x, y).shared
    for spec in ["prune:0.9", "clip:0.1", "clip:0.1,layer", "noise:0.01", "graddrop:0.5", "quantize:4",
                 "clip:1+noise:0.01"]:
        obs = lb.observe(model, x, y, defense=spec, seed=5)
        expected = parse(spec)(clean, seed=5)
        assert obs.defense == spec and obs.kind == "gradient"
        assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(obs.shared, expected)), spec
    assert lb.observe(model, x, y, defense="clip:0.1").extras["defense"]["clip"]["max_norm"] == 0.1
    assert lb.observe(model, x, y, defense="clip:0.1,layer").extras["defense"]["clip"]["scope"] == "layer"
