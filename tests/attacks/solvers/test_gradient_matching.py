"""Quality of the gradient-matching attacks at test budgets (DLG, Inverting Gradients)."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import leakbench as lb


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("seed", [0, 1])
def test_dlg_recovers_digit_on_sigmoid_lenet(seed):
    """DLG (soft labels, L-BFGS on L2) on the sigmoid LeNet at 16×16: MSE < 1e-4 and the right label."""
    ds = lb.load("digits", size=16)
    x, y = ds.batch(1, seed=seed)
    model = lb.build("lenet", input_shape=ds.shape, classes=10, seed=seed)
    obs = lb.observe(model, x, y)
    rec = lb.attack("dlg", obs, iterations=60, seed=seed)
    score = lb.compare(rec, x, y)
    assert score["mse"] < 1e-4
    assert score["label_acc"] == 1.0


def test_idlg_preset_uses_recovered_label():
    ds = lb.load("digits", size=16)
    x, y = ds.batch(1, seed=3)
    obs = lb.observe(lb.build("lenet", input_shape=ds.shape, classes=10, seed=3), x, y)
    rec = lb.attack("dlg", obs, preset="idlg", iterations=60)
    assert rec.labels.tolist() == y.tolist()
    assert lb.compare(rec, x, y)["mse"] < 1e-4


@pytest.mark.slow  # ~17 s on 2 threads: `make test-slow`; the default suite keeps DLG's digit recovery and the local-update
# inversion below, and benchmarks/bench_inverting.py measures the photo quality
def test_inverting_gradients_reaches_20db_on_photo():
    """Inverting Gradients on a small ConvNet with a 32×32 photo reaches ≥ 20 dB PSNR at the quick budget."""
    ds = lb.load("photos", size=32)
    x, y = ds.batch(1, seed=0)
    model = lb.build("convnet-16", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval()
    obs = lb.observe(model, x, y)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))  # this ConvNet is large enough to gain from 2 (19 → 14 s)
    try:
        rec = lb.attack("inverting-gradients", obs, preset="quick")
    finally:
        torch.set_num_threads(threads)
    score = lb.compare(rec, x, y)
    assert score["psnr"] >= 20.0
    assert score["label_acc"] == 1.0
    assert rec.images.min() >= 0 and rec.images.max() <= 1  # box constraint


@pytest.mark.slow  # ~10 s: `make test-slow` (the batch-size effect is in the benchmarks)
def test_inverting_gradients_degrades_with_batch_size():
    """The same budget rebuilds one image better than each of four (the known batch-size effect)."""
    ds = lb.load("photos", size=32)
    model = lb.build("convnet-8", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval()
    scores = []
    for batch in (1, 4):
        x, y = ds.batch(batch, seed=0)
        rec = lb.attack("inverting-gradients", lb.observe(model, x, y, labels_known=True), preset="quick",
                        iterations=120)
        scores.append(lb.compare(rec, x, y)["psnr"])
    assert scores[0] > scores[1]


def test_update_observation_is_inverted_by_simulating_local_steps():
    """FedAvg-style update (3 local steps): matching the simulated update rebuilds the digit."""
    ds = lb.load("digits", size=16)
    x, y = ds.batch(1, seed=0)
    model = lb.build("lenet", input_shape=ds.shape, classes=10, seed=0)
    obs = lb.observe(model, x, y, local_steps=3, local_lr=0.01, labels_known=True)
    rec = lb.attack("dlg", obs, preset="idlg", iterations=60)
    assert lb.compare(rec, x, y)["mse"] < 1e-3


def test_first_order_local_model_is_every_step_at_the_received_weights():
    """local_model="first-order": Δθ = −η Σ_s ∇L_{b_s}(θ₀), by plain autograd per minibatch; the same as the exact
    simulation for one step, and not for two (the second step's weights differ)."""
    from leakbench.attacks.solvers.gradient_matching import GradientMatcher
    from leakbench.attacks.solvers.matching_settings import MatchingSettings

    ds = lb.load("digits")
    model = lb.build("cnn:3-4-2-1", input_shape=ds.shape, classes=10, act="tanh", seed=0).double()
    x, y = ds.batch(4, seed=1)
    x = x.double()
    candidate = torch.rand(x.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    obs = lb.observe(model, x, y, labels_known=True, local_steps=1, local_lr=0.05, local_batch=2)
    first = GradientMatcher(obs, MatchingSettings(local_model="first-order")).shared_of(candidate, y)
    params = dict(model.named_parameters())
    expected = [torch.zeros_like(p) for p in params.values()]
    for idx in obs.local_batches:
        loss = torch.nn.functional.cross_entropy(model(candidate[idx]), y[idx])
        for total, g in zip(expected, torch.autograd.grad(loss, list(params.values()))):
            total -= 0.05 * g
    assert all(torch.allclose(a, b, atol=1e-14, rtol=1e-12) for a, b in zip(first, expected))
    exact = GradientMatcher(obs, MatchingSettings(local_model="exact")).shared_of(candidate, y)
    assert not all(torch.allclose(a, b, atol=1e-12) for a, b in zip(first, exact))
    one = lb.observe(model, x, y, labels_known=True, local_steps=1, local_lr=0.05)   # one step: the same model
    a = GradientMatcher(one, MatchingSettings(local_model="first-order")).shared_of(candidate, y)
    b = GradientMatcher(one, MatchingSettings(local_model="exact")).shared_of(candidate, y)
    assert all(torch.allclose(u.dense() if hasattr(u, "dense") else u, v.dense() if hasattr(v, "dense") else v,
                              atol=1e-14) for u, v in zip(a, b))
    with pytest.raises(lb.ConfigError, match="local_model"):
        lb.attack("inverting-gradients", obs, preset="quick", local_model="second-order")


# -- factorised linear layers ---------------------------------------------------------------------------------

def _head_observation(*, train: bool = False, width: int = 600, spec: str = "convnet-2", **observe):
    """A float64 model (convnet-2: BN) at 12 px with a random head of ``width`` neurons: its wide linear layer."""
    from leakbench.models.malicious import random_head

    ds = lb.load("photos", size=12)
    x, y = ds.batch(2, seed=0)
    model = lb.build(spec, input_shape=ds.shape, classes=ds.num_classes, seed=0, dtype=torch.float64)
    shipped = random_head(model, width=width, seed=0)
    return lb.observe(shipped, x.double(), y, labels_known=True, train=train, bn_stats=train, **observe), y


def _match(obs, labels, **settings):
    from leakbench.attacks.solvers.gradient_matching import GradientMatcher
    from leakbench.attacks.solvers.matching_settings import MatchingSettings

    matcher = GradientMatcher(obs, MatchingSettings(iterations=6, trace_every=1, **settings))
    return matcher, matcher.run(labels, seed=0)


@pytest.mark.parametrize("options", [
    dict(distance="cosine"),
    dict(distance="l2", signed=False, lr=1e-3),
    dict(distance="cosine-layer", weights="l0"),
    dict(distance="cosine", train=True, bn=0.01, tv=0.01),     # BN in training mode, the BN prior, TV
    dict(distance="cosine", local_steps=1, local_lr=0.1),       # an update of one local step
    # one inner iteration: L-BFGS's absolute tolerance_change (1e-9) lets longer inner loops branch on 1e-12 differences
    dict(distance="l2", optimizer="lbfgs", lbfgs_max_iter=1),
])
def test_factorised_linear_layers_give_the_dense_reconstruction(options):
    """δᵀz never formed: the same loss curve and the same images as the dense path (float64)."""
    options = dict(options)
    observe = {k: options.pop(k) for k in ("train", "local_steps", "local_lr") if k in options}
    obs, y = _head_observation(**observe)
    dense_m, dense = _match(obs, y, factorise="off", **options)
    fact_m, fact = _match(obs, y, factorise="on", **options)
    assert dense_m.factorised == [] and "fc.random.weight" in fact_m.factorised
    assert fact.trace["factorised"] == fact_m.factorised
    curves = torch.tensor(fact.trace["loss"]), torch.tensor(dense.trace["loss"])
    torch.testing.assert_close(*curves, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(fact.images, dense.images, rtol=0, atol=1e-9)


def test_factorising_falls_back_to_dense_where_it_cannot_stand_for_the_gradient():
    """Several local steps, a weight also used outside its module's call, a tied weight: dense, same results."""
    from torch import nn

    from leakbench.attacks.solvers.gradient_matching import GradientMatcher
    from leakbench.attacks.solvers.matching_settings import MatchingSettings

    obs, _ = _head_observation(local_steps=2, local_lr=0.1)
    assert GradientMatcher(obs, MatchingSettings(factorise="on")).factorised == []

    class Reused(nn.Module):  # fc.weight also enters through F.linear: δᵀz of fc's own call is not its gradient
        def __init__(self):
            super().__init__()
            self.flat, self.fc, self.out = nn.Flatten(), nn.Linear(48, 40), nn.Linear(40, 3)

        def forward(self, x):
            h = self.flat(x)
            return self.out(torch.tanh(self.fc(h)) + 0.5 * torch.nn.functional.linear(h, self.fc.weight))

    torch.manual_seed(0)
    tied = nn.Sequential(nn.Flatten(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 3))
    tied[3].weight = tied[1].weight
    x = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for model, wide, eligible in ((Reused().double(), "fc.weight", True), (tied.double(), "1.weight", False)):
        model.input_shape, model.classes = (3, 4, 4), 3
        labels = torch.tensor([0, 2])
        obs = lb.observe(model, x, labels, labels_known=True)
        dense = _match(obs, labels, factorise="off")[1]
        fact_m = GradientMatcher(obs, MatchingSettings(iterations=6, trace_every=1, factorise="on"))
        assert (wide in fact_m.factorised) == eligible  # tied weights are never factorised
        fact = fact_m.run(labels, seed=0)
        assert wide not in fact_m.factorised  # the first step's check against autograd dropped it
        torch.testing.assert_close(fact.images, dense.images, rtol=0, atol=1e-9)


def test_auto_factorises_only_wide_layers_and_batched_restarts_stay_dense():
    from leakbench.attacks.solvers.matching_settings import FACTORISE_MIN

    obs, y = _head_observation(width=5000, spec="mlp:64")
    matcher, _ = _match(obs, y)  # factorise="auto"
    params = obs.params()
    assert matcher.factorised == [n for n in obs.param_names if n.endswith("weight") and params[n].dim() == 2
                                  and params[n].numel() >= FACTORISE_MIN] == ["fc.random.weight"]
    dense = _match(obs, y, factorise="off", restarts=2, batched_restarts=True)[1]
    fact = _match(obs, y, factorise="on", restarts=2, batched_restarts=True)[1]
    torch.testing.assert_close(fact.images, dense.images, rtol=0, atol=0)


def test_tv_growth_weighs_tv_by_a_power_of_the_batch():
    """``tv_growth = g`` runs exactly the objective with α_TV · B^g (same seed, same images); 0 leaves α_TV
    (the `fast` preset grows it as B^(2/3); 0 here turns that off)."""
    ds = lb.load("photos", size=16)
    x, y = ds.batch(4, seed=0)
    obs = lb.observe(lb.build("convnet-8", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval(), x, y,
                     labels_known=True)
    grown = lb.attack("inverting-gradients", obs, preset="fast", iterations=15, tv=1e-6, tv_growth=1.5)
    fixed = lb.attack("inverting-gradients", obs, preset="fast", iterations=15, tv=8e-6, tv_growth=0.0)
    assert grown.trace["tv"] == pytest.approx(8e-6) and fixed.trace["tv"] == pytest.approx(8e-6)
    assert torch.equal(grown.images, fixed.images)
    plain = lb.attack("inverting-gradients", obs, preset="fast", iterations=15, tv=1e-6, tv_growth=0.0)
    assert plain.trace["tv"] == pytest.approx(1e-6) and not torch.equal(plain.images, grown.images)


@pytest.mark.parametrize("bad", [-0.5, float("nan")])
def test_tv_growth_refuses_a_negative_or_nan_power(bad):
    ds = lb.load("photos", size=16)
    x, y = ds.batch(1, seed=0)
    obs = lb.observe(lb.build("convnet-8", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval(), x, y)
    with pytest.raises(lb.ConfigError, match="tv_growth"):
        lb.attack("inverting-gradients", obs, iterations=2, tv_growth=bad)


def test_fast_preset_keeps_its_tuned_tv_at_batch_one_and_grows_it_with_the_batch():
    ds = lb.load("photos", size=16)
    model = lb.build("convnet-8", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval()
    for batch, tv in ((1, 1e-4), (8, 4e-4)):
        x, y = ds.batch(batch, seed=0)
        rec = lb.attack("inverting-gradients", lb.observe(model, x, y, labels_known=True), preset="fast",
                        iterations=1)
        assert rec.trace["tv"] == pytest.approx(tv)


def test_trained_preset_is_fast_with_a_fixed_strong_tv_at_every_batch_size():
    """``trained`` changes only the TV prior of ``fast``: α_TV 0.1 that does not grow with B."""
    from leakbench.attacks import create
    fast = dataclasses.asdict(create("inverting-gradients", preset="fast").options)
    trained = dataclasses.asdict(create("inverting-gradients", preset="trained").options)
    assert {k for k in fast if fast[k] != trained[k]} == {"tv", "tv_growth"}
    ds = lb.load("photos", size=16)
    model = lb.build("convnet-8", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval()
    for batch in (1, 8):
        x, y = ds.batch(batch, seed=0)
        rec = lb.attack("inverting-gradients", lb.observe(model, x, y, labels_known=True), preset="trained",
                        iterations=1)
        assert rec.trace["tv"] == pytest.approx(0.1)


def test_an_attack_that_ends_at_chance_says_so_in_its_trace():
    """Against a grey image's gradient distance (the attacker's own measure of chance): a converged DLG run beats
    it and says nothing; two steps far too large do not, and the trace says so."""
    ds = lb.load("digits", size=16)
    x, y = ds.batch(1, seed=0)
    obs = lb.observe(lb.build("lenet", input_shape=ds.shape, classes=10, seed=0), x, y)
    good = lb.attack("dlg", obs, iterations=60, seed=0)
    assert good.trace["final_match"] < good.trace["grey_match"] and "chance" not in good.trace
    early = lb.attack("inverting-gradients", obs, iterations=2, lr=10.0, seed=0)   # a step far too large
    assert early.trace["final_match"] >= early.trace["grey_match"], early.trace
    assert "no better than a grey image" in early.trace["chance"]
    assert lb.compare(early, x, y)["psnr"] < lb.compare(torch.full_like(x, 0.5), x, y)["psnr"]


def test_stacked_problems_say_when_they_end_at_chance_as_alone():
    """attack_batch (what sweeps run) measures each problem against a grey image too: the same grey distance and
    the same chance line as the problem run alone."""
    from leakbench.attacks import attack_batch

    ds = lb.load("digits", size=16)
    model = lb.build("lenet", input_shape=ds.shape, classes=10, seed=0)
    observations = [lb.observe(model, *ds.batch(1, seed=s)) for s in (0, 1)]
    options = dict(iterations=2, lr=10.0)   # a step far too large: ends at chance
    stacked = attack_batch("inverting-gradients", observations, seeds=[0, 0], **options)
    for obs, rec in zip(observations, stacked):
        alone = lb.attack("inverting-gradients", obs, seed=0, **options)
        assert rec.trace["grey_match"] == pytest.approx(alone.trace["grey_match"], rel=1e-5)
        assert ("chance" in rec.trace) == ("chance" in alone.trace) == (rec.trace["final_match"] >= rec.trace["grey_match"])
    assert any("no better than a grey image" in r.trace.get("chance", "") for r in stacked)
