"""Stacked independent problems (attack_batch) give each problem what it gets alone, per attack."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks import attack_batch
from leakbench.attacks.solvers.batched_matching import DivergedMatch, StackedMatching

# float64 throughout: signed Adam turns a rounding difference in a near-zero gradient entry into a full step,
# so float32 runs agree to rounding only for a while; in float64 the stacked run equals the sequential one
DATA = lb.load("digits")


def _observations(count: int, batch: int, *, spec: str = "cnn:3-4-2-1", act: str = "tanh", **observe) -> list:
    model = lb.build(spec, input_shape=DATA.shape, classes=10, act=act, seed=0).double()
    out = []
    for t in range(count):
        x, y = DATA.batch(size=batch, seed=100 + t)
        out.append(lb.observe(model, x.double(), y, defense="noise:0.001" if t % 2 else "none", seed=t, **observe))
    return out


def _same_as_alone(name: str, observations: list, **options) -> list:
    seeds = [3 * i + 1 for i in range(len(observations))]
    stacked = attack_batch(name, observations, seeds=seeds, **options)
    for obs, seed, rec in zip(observations, seeds, stacked):
        alone = lb.attack(name, obs, seed=seed, **options)
        assert not isinstance(rec, Exception), rec
        assert torch.allclose(rec.images, alone.images, atol=1e-9, rtol=0)
        assert torch.equal(rec.labels.reshape(-1), alone.labels.reshape(-1))
        assert rec.trace["final_match"] == pytest.approx(alone.trace["final_match"], rel=1e-9, abs=1e-12)
        assert rec.trace["loss"] == pytest.approx(alone.trace["loss"], rel=1e-9, abs=1e-12)
    return stacked


def test_inverting_gradients_stacked_equals_alone():
    stacked = _same_as_alone("inverting-gradients", _observations(3, 1), preset="quick", iterations=12, trace_every=4)
    assert all(r.trace["stacked"] == 3 for r in stacked)


def test_restarts_and_a_local_update_stack_too():
    _same_as_alone("inverting-gradients", _observations(2, 2, local_steps=2, local_lr=0.05), preset="quick",
                   iterations=8, restarts=2)


def test_a_first_order_local_model_stacks_too():
    _same_as_alone("inverting-gradients", _observations(2, 4, local_steps=1, local_lr=0.05, local_batch=2),
                   preset="quick", iterations=8, local_model="first-order")


def test_dlg_with_adam_and_soft_labels_stacked_equals_alone():
    stacked = _same_as_alone("dlg", _observations(3, 1), iterations=10, optimizer="adam", lr=0.05,
                             schedule="multistep")
    assert all(r.trace["stacked"] == 3 for r in stacked)


def test_liu2024_on_pixels_stacked_equals_alone():
    _same_as_alone("liu2024", _observations(2, 2), generator=False, feature=0.0, iterations=10)


def test_output_layer_features_stack_per_label_count():
    # B = 4 digits without noise: the features are recovered; batches of 2, 3 and 4 distinct labels (padded)
    # (sigmoid: small logits, so same-label images' loss gradients agree and the features are determined)
    model = lb.build("cnn:3-4-2-1", input_shape=DATA.shape, classes=10, act="sigmoid", seed=0).double()
    by_label = [torch.nonzero(DATA.labels == c).flatten().tolist() for c in range(10)]
    batches = [[by_label[0][0], by_label[0][1], by_label[1][0], by_label[1][1]],
               [by_label[2][0], by_label[2][1], by_label[3][0], by_label[4][0]],
               [by_label[5][0], by_label[6][0], by_label[7][0], by_label[8][0]]]
    observations = []
    for idx in batches:
        x, y = DATA.batch(indices=idx)
        observations.append(lb.observe(model, x.double(), y))
    stacked = _same_as_alone("inverting-gradients", observations, preset="fast", iterations=10)
    assert all(r.trace["features"]["used"] for r in stacked)
    assert all(r.trace["stacked"] == 3 for r in stacked)
    assert len({r.trace["features"]["labels"] for r in stacked}) > 1, "batches with different label counts"


def test_lbfgs_runs_alone_and_says_why():
    stacked = _same_as_alone("dlg", _observations(2, 1), iterations=3)
    assert all("L-BFGS" in r.trace["alone"] for r in stacked)


def test_a_diverging_problem_fails_alone_and_leaves_the_others_unchanged():
    observations = _observations(3, 1)
    poisoned = observations[1]
    poisoned.shared[0] = poisoned.shared[0].clone()
    poisoned.shared[0].view(-1)[0] = float("nan")
    out = attack_batch("inverting-gradients", observations, seeds=[1, 4, 7], preset="quick", iterations=10)
    assert isinstance(out[1], DivergedMatch) and "non-finite" in str(out[1])
    for i in (0, 2):
        alone = lb.attack("inverting-gradients", observations[i], seed=[1, 4, 7][i], preset="quick", iterations=10)
        assert torch.allclose(out[i].images, alone.images, atol=1e-9, rtol=0)


def test_unmet_requirements_are_per_problem():
    observations = _observations(2, 1)
    vector = lb.observe(lb.build("mlp:8", input_shape=(4,), classes=3, seed=0), torch.rand(1, 4), torch.tensor([1]))
    out = attack_batch("inverting-gradients", [observations[0], vector, observations[1]], preset="quick",
                       iterations=3)
    assert isinstance(out[1], lb.errors.UnsupportedThreatModel) and "TV prior" in str(out[1])
    assert all(isinstance(r, lb.Reconstruction) for r in (out[0], out[2]))


def test_vmap_and_block_stacking_agree():
    from leakbench.attacks import GradientMatcher, create, recover_labels

    observations = _observations(3, 2)
    options = create("inverting-gradients", preset="quick", iterations=6).options
    images = {}
    for mode in ("vmap", "block"):
        matchers = [GradientMatcher(o, options) for o in observations]
        labels = [recover_labels(o) for o in observations]
        images[mode] = [r.images for r in StackedMatching(matchers, labels, stacking=mode).run([0, 1, 2])]
    assert all(torch.allclose(a, b, atol=1e-9, rtol=0) for a, b in zip(images["vmap"], images["block"]))


def test_unique_label_features_stack_too():
    model = lb.build("cnn:3-4-2-1", input_shape=DATA.shape, classes=10, act="sigmoid", seed=0).double()
    by_label = [torch.nonzero(DATA.labels == c).flatten().tolist() for c in range(10)]
    batches = [[by_label[0][0], by_label[0][1], by_label[1][0], by_label[2][0]],
               [by_label[3][0], by_label[4][0], by_label[5][0], by_label[6][0]]]
    observations = [lb.observe(model, *(lambda x, y: (x.double(), y))(*DATA.batch(indices=idx))) for idx in batches]
    stacked = _same_as_alone("inverting-gradients", observations, preset="fast", iterations=10,
                             features_labels="unique")
    assert [r.trace["features"]["labels"] for r in stacked] == [2, 4]
