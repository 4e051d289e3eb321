"""The literature's defenses (soteria, topk, mixup, instahide): each one's defining property and bad specs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leakbench as lb
from leakbench.defenses import parse, share
from leakbench.defenses.literature import (
    _beta,
    error_feedback,
    instahide_draw,
    instahide_encode,
    representation_layer,
    soft_targets,
    soteria_mask,
    soteria_scores,
    topk_count,
    topk_sparsify,
)
from leakbench.defenses.pipeline import mean_gradient
from leakbench.errors import ConfigError
from leakbench.evaluation.training.seeds import seeds_refusal
from leakbench.losses import get_loss


@pytest.fixture(scope="module")
def setting():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 36, 12), nn.Tanh(),
                          nn.Linear(12, 5))
    x = torch.rand(3, 1, 6, 6, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 3, 4])
    params = {n: p.detach() for n, p in model.named_parameters()}
    return model, params, x, y, get_loss("ce")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_soteria_zeroes_exactly_the_chosen_columns_and_leaves_the_rest_bit_identical(setting):
    model, params, x, y, loss_fn = setting
    plain = mean_gradient(model, params, x, y, loss_fn, _gen())
    shared = share("soteria:0.25", model, params, x, y, loss_fn, generator=_gen()).tensors
    name, layer = representation_layer(model)
    assert name == "5"
    keep = soteria_mask(soteria_scores(model, params, x, layer), 0.25)
    assert int((~keep).sum()) == 3  # ⌊0.25 · 12⌋
    k = list(params).index("5.weight")
    for i, (a, b) in enumerate(zip(plain, shared)):
        if i != k:
            assert torch.equal(a, b), list(params)[i]
    assert torch.equal(shared[k][:, keep], plain[k][:, keep])
    assert bool((shared[k][:, ~keep] == 0).all())
    assert bool((plain[k][:, ~keep] != 0).any())


def test_soteria_scores_are_the_per_element_ratio_of_the_paper(setting):
    model, params, x, y, _ = setting
    _, layer = representation_layer(model)
    scores = soteria_scores(model, params, x, layer)
    body = nn.Sequential(*list(model)[:5])
    expected = torch.zeros(12)
    for b in range(x.shape[0]):
        jac = torch.autograd.functional.jacobian(lambda v: body(v.unsqueeze(0))[0], x[b])  # 12 × 1 × 6 × 6
        r = body(x[b:b + 1])[0].detach()
        expected += r.abs() / jac.flatten(1).norm(dim=1)
    assert torch.allclose(scores, expected, rtol=1e-4)
    keep = soteria_mask(scores, 0.5)
    assert set(torch.nonzero(~keep).flatten().tolist()) == set(scores.topk(6).indices.tolist())


@pytest.mark.parametrize("spec, field", [("soteria:1.5", "pruned fraction p"), ("topk:0", "kept fraction k"),
                                         ("topk:2", "kept fraction k"), ("mixup:-1", "Beta parameter"),
                                         ("instahide:1", "number of mixed images k"),
                                         ("instahide:4,0.2", "coefficient cap c")])
def test_bad_specs_are_one_line_errors_naming_the_field(spec, field):
    with pytest.raises(ConfigError) as err:
        parse(spec)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_soteria_needs_a_fully_connected_classifier_and_one_gradient_owner(setting):
    _, params, x, y, loss_fn = setting
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten())
    with pytest.raises(ConfigError, match="fully connected"):
        share("soteria:0.5", conv, {n: p.detach() for n, p in conv.named_parameters()}, x, y, loss_fn,
              generator=_gen())
    with pytest.raises(ConfigError, match="one defense that replaces"):
        share("soteria:0.5+mixup:1", setting[0], params, x, y, loss_fn, generator=_gen())


def test_topk_keeps_the_largest_entries():
    g = [torch.randn(10, 7, generator=_gen(2)), torch.randn(13, generator=_gen(3))]
    sent = topk_sparsify(g, 0.1)
    kept = torch.cat([s.flatten() for s in sent])
    flat = torch.cat([t.flatten() for t in g])
    assert int((kept != 0).sum()) == topk_count(0.1, 83) == 9
    assert float(flat.abs()[kept == 0].max()) <= float(kept.abs()[kept != 0].min())


def test_error_feedback_residual_plus_sent_equals_the_accumulated_gradient():
    defense = parse("topk:0.05")
    gen = _gen()
    total = sent_total = None
    for t in range(6):
        g = [torch.randn(20, 5, generator=_gen(10 + t)), torch.randn(5, generator=_gen(20 + t))]
        sent = defense(g, generator=gen)
        total = g if total is None else [a + b for a, b in zip(total, g)]
        sent_total = sent if sent_total is None else [a + b for a, b in zip(sent_total, sent)]
        residual = defense.residual(gen)
        for a, s, e in zip(total, sent_total, residual):
            assert torch.allclose(s + e, a, atol=1e-5)
    assert defense.residual(_gen()) is None  # another run (another stream) starts from e_0 = 0
    one, res = error_feedback(g, None, 0.05)
    assert all(torch.equal(a + b, c) for a, b, c in zip(one, res, g))


def test_topk_without_error_feedback_keeps_no_memory():
    defense = parse("topk:0.1,false")
    gen = _gen()
    defense([torch.randn(30, generator=gen)], generator=gen)
    assert defense.residual(gen) is None and defense.spec == "topk:0.1,false"


def test_mixup_gradient_is_the_gradient_at_the_mixed_input(setting):
    model, params, x, y, loss_fn = setting
    shared = share("mixup:0.4", model, params, x, y, loss_fn, generator=_gen(5)).tensors
    gen = _gen(5)
    lam = _beta(0.4, gen)
    perm = torch.randperm(3, generator=gen)
    mixed = lam * x + (1 - lam) * x[perm]
    soft = lam * F.one_hot(y, 5).float() + (1 - lam) * F.one_hot(y[perm], 5).float()
    live = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    out = torch.func.functional_call(model, live, (mixed,))
    expected = torch.autograd.grad(F.cross_entropy(out, soft), list(live.values()))
    assert 0 < lam < 1
    for a, b in zip(shared, expected):
        assert torch.allclose(a, b, atol=1e-6)


def test_beta_draws_follow_beta():
    draws = torch.tensor([_beta(2.0, g) for g in [_gen()] for _ in range(4000)])
    assert abs(float(draws.mean()) - 0.5) < 0.02 and abs(float(draws.var()) - 1 / 20) < 0.006


def test_instahide_encodes_in_the_box_with_the_paper_s_coefficients_and_absolute_values(setting):
    model, params, x, y, loss_fn = setting
    lam, partners, signs = instahide_draw(x, 3, 0.65, _gen(7))
    assert torch.allclose(lam.sum(1), torch.ones(3, dtype=lam.dtype)) and float(lam.max()) <= 0.65
    assert torch.equal(partners[:, 0], torch.arange(3))
    assert all(sorted(partners[:, j].tolist()) == [0, 1, 2] for j in range(3))  # each image in exactly k encodings
    enc = instahide_encode(x, lam, partners, signs, 0.5)
    assert float(enc.min()) >= 0 and float(enc.max()) <= 1
    plain = sum(lam[:, j, None, None, None].float() * (x[partners[:, j]] - 0.5) for j in range(3))
    assert torch.allclose((enc - 0.5).abs(), plain.abs(), atol=1e-6)
    shared = share("instahide:3", model, params, x, y, loss_fn, generator=_gen(7)).tensors
    live = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    out = torch.func.functional_call(model, live, (enc,))
    target = soft_targets(y, lam, partners, 5).float()
    expected = torch.autograd.grad(F.cross_entropy(out, target), list(live.values()))
    for a, b in zip(shared, expected):
        assert torch.allclose(a, b, atol=1e-6)


def test_step_defenses_train_their_seeds_one_after_the_other(setting):
    model = setting[0]
    assert "soteria" in seeds_refusal(parse("soteria:0.5"), model)
    assert "mixup" in seeds_refusal(parse("mixup:1"), model)
    assert seeds_refusal(parse("topk:0.1"), model) is None  # a shared-stage defense: per-seed streams, per-seed memory


def test_observe_records_the_defense_for_the_adaptive_attacks():
    data = lb.load("digits")
    model = lb.build("mlp:16", input_shape=data.shape, classes=10, seed=0)
    x, y = data.batch(2, seed=0)
    obs = lb.observe(model, x, y, defense="topk:0.1", seed=0)
    assert obs.defense == "topk:0.1" and obs.extras["defense"]["topk"]["error_feedback"] is True
    nonzero = sum(int((t != 0).sum()) for t in obs.shared)
    assert nonzero == topk_count(0.1, sum(t.numel() for t in obs.shared))


def test_topk_pickles_without_its_memory():
    import pickle

    defense = parse("topk:0.2")
    gen = _gen()
    defense([torch.randn(10, generator=gen)], generator=gen)
    copy = pickle.loads(pickle.dumps(defense))
    assert copy.spec == "topk:0.2" and copy.residual(gen) is None and defense.residual(gen) is not None


def test_topk_keeps_one_memory_per_client_under_secure_aggregation():
    from leakbench.defenses.base import client_scope

    defense = parse("topk:0.1")
    gen = _gen()
    g0, g1 = [torch.randn(40, generator=_gen(1))], [torch.randn(40, generator=_gen(2))]
    with client_scope(0):
        s0 = defense(g0, generator=gen)
    with client_scope(1):
        s1 = defense(g1, generator=gen)
    # the second client of the same observation starts from e_0 = 0: it sends the top-k of its own gradient
    assert torch.equal(s1[0], topk_sparsify(g1, 0.1)[0])
    assert torch.equal(defense.residual(gen, client=1)[0], g1[0] - s1[0])
    assert torch.equal(defense.residual(gen)[0], g0[0] - s0[0])


def test_topk_under_secagg_sends_each_clients_own_top_k(monkeypatch):
    from leakbench.defenses import pipeline

    data = lb.load("digits")
    model = lb.build("mlp:16", input_shape=data.shape, classes=10, seed=0)
    x, y = data.batch(2, seed=0)
    seen: list = []
    real = pipeline.client_round

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(pipeline, "client_round", spy)
    lb.observe(model, x, y, defense="secagg:3", population=data, seed=0)      # the clients' own gradients
    raw, seen[:] = list(seen), []
    lb.observe(model, x, y, defense="topk:0.05+secagg:3", population=data, seed=0)   # top-k draws nothing
    assert len(raw) == len(seen) == 3
    for own, sent in zip(raw, seen):   # no client sends part of another client's residual
        assert all(torch.equal(a, b) for a, b in zip(topk_sparsify(own, 0.05), sent))
