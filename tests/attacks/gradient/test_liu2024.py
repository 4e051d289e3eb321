"""Liu et al. (2024)'s attack: feature term, deep image prior, comparison with Inverting Gradients."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks.gradient.liu2024 import feature_loss
from leakbench.models.malicious import random_head


@pytest.fixture(scope="module")
def photos():
    return lb.load("photos", size=16)


def _public(photos, x, count=200):
    """The server's public images: ``count`` photos that are not in the batch."""
    flat = photos.images.reshape(len(photos.images), -1)
    inside = (flat[:, None, :] == x.reshape(x.shape[0], -1)[None]).all(-1).any(-1)
    return photos.images[~inside][-count:]


def _setup(photos, *, defense=None, seed=0, width=40_000):
    """ConvNet-8 (BN, training mode, statistics granted as in Liu et al. Sec. 5.1) + the random head,
    its input centred on public images (``center="calibration"``: random-CNN features are nearly collinear)."""
    model = lb.build("convnet-8", input_shape=photos.shape, classes=photos.num_classes, seed=seed)
    x, y = photos.batch(4, seed=seed)
    shipped = random_head(model, width=width, seed=seed, center="calibration", calibration=_public(photos, x))
    obs = lb.observe(shipped, x, y, labels_known=True, train=True, bn_stats=True, defense=defense)
    return x, obs


def test_feature_loss_is_zero_at_the_recovered_features_up_to_order_sign_and_scale():
    gen = torch.Generator().manual_seed(0)
    z = torch.nn.functional.normalize(torch.randn(4, 20, generator=gen), dim=1)
    shuffled = -3.0 * z[[2, 0, 3, 1]]
    assert float(feature_loss(shuffled, z, form="cosine")) < 1e-6
    assert float(feature_loss(shuffled, z, form="projection")) < 1e-6
    other = torch.randn(4, 20, generator=gen)
    assert float(feature_loss(other, z, form="cosine")) > 0.3
    assert 0 < float(feature_loss(other, z, form="projection")) <= 1


def test_feature_loss_gradient_pulls_towards_the_features():
    gen = torch.Generator().manual_seed(1)
    z = torch.nn.functional.normalize(torch.randn(3, 10, generator=gen), dim=1)
    f = (z + 0.5 * torch.randn(3, 10, generator=gen)).requires_grad_(True)
    opt = torch.optim.SGD([f], lr=0.5)
    first = float(feature_loss(f, z, form="cosine").detach())
    for _ in range(100):
        opt.zero_grad()
        feature_loss(f, z, form="cosine").backward()
        opt.step()
    assert float(feature_loss(f, z, form="cosine").detach()) < first / 10


def test_short_run_returns_box_images_and_trace(photos):
    x, obs = _setup(photos, width=8_000)  # the shapes and trace of a short run do not depend on the width
    rec = lb.attack("liu2024", obs, preset="quick", iterations=10)
    assert rec.images.shape == x.shape
    assert float(rec.images.min()) >= 0 and float(rec.images.max()) <= 1
    assert rec.trace["features"].shape[0] == 4 and rec.trace["feature_form"] == "signed"
    assert rec.trace["feature_signs"] == "first moment"
    assert rec.labels.tolist() == obs.labels.tolist()
    assert len(rec.trace["loss"]) >= 1


def test_runs_without_the_random_block_when_the_feature_term_is_off(photos):
    model = lb.build("cnn:3-4-2-1", input_shape=photos.shape, classes=photos.num_classes, seed=0)
    x, y = photos.batch(2, seed=0)
    obs = lb.observe(model, x, y, labels_known=True)
    with pytest.raises(lb.UnsupportedThreatModel, match="feature=0"):
        lb.attack("liu2024", obs, preset="quick", iterations=5)
    rec = lb.attack("liu2024", obs, preset="quick", iterations=5, feature=0.0)
    assert rec.images.shape == x.shape and rec.trace["bn_prior"].startswith("off")
    pixels = lb.attack("liu2024", obs, preset="quick", iterations=5, feature=0.0, generator=False, lr=0.1)
    assert pixels.images.shape == x.shape


@pytest.mark.parametrize("option, value", [("feature_form", "l2"), ("weights", "l1"), ("block_weight", "none"),
                                           ("distance", "l2"), ("schedule", "linear"), ("step_unit", "pixels"),
                                           ("init_std", 0)])
def test_bad_options_name_the_option(option, value):
    with pytest.raises(lb.ConfigError, match=f"option {option}"):
        lb.attacks.create("liu2024", **{option: value})


def test_signed_form_tells_a_feature_from_its_mirror():
    gen = torch.Generator().manual_seed(2)
    z = torch.nn.functional.normalize(torch.randn(3, 12, generator=gen), dim=1)
    assert float(feature_loss(2.0 * z[[1, 2, 0]], z, form="signed")) < 1e-6
    assert float(feature_loss(-z[:1], z[:1], form="signed")) > 1.99  # one feature: its mirror costs 2
    assert float(feature_loss(-z, z, form="signed")) > 1.0          # a batch of mirrors: > 1 whatever the matching
    assert float(feature_loss(-z, z, form="cosine")) < 1e-6         # the paper's squared cosine cannot tell


def test_block_weights_of_the_random_head(photos):
    from leakbench.attacks.gradient.liu2024 import tensor_weights
    _, obs = _setup(photos, width=8_000)
    names = obs.param_names
    l0 = tensor_weights(obs, "l0", "l0")
    assert l0 == "l0"
    excluded = tensor_weights(obs, "l0", "exclude")
    mean = tensor_weights(obs, "l0", "mean")
    block = [i for i, n in enumerate(names) if ".random." in n or ".out." in n]
    assert len(block) == 2 and all(excluded[i] == 0 for i in block)
    others = [w for i, w in enumerate(mean) if i not in block]
    assert all(abs(mean[i] - sum(others) / len(others)) < 1e-9 for i in block)
    params = obs.params()
    assert all(excluded[i] == float((params[n] != 0).sum()) for i, n in enumerate(names) if i not in block)


def test_global_and_per_layer_clipping_are_invisible_to_the_objective_and_the_tensor_step(photos):
    """L_grad is Σ_i w_i (1 − cos_i) over parameter tensors (App. F) and the tensor step uses ∇A₂ up to scale:
    ``clip:C`` and ``clip:C,layer`` multiply each tensor by a positive factor, so neither term can feel them —
    whence the ablation below clips per sample (``dpsgd:C,0``), which reweights the samples and does change L_grad."""
    from leakbench.attacks.gradient.tensor_features import (
        find_block,
        shared_gradient,
        tensor_features,
    )
    from leakbench.attacks.solvers.objectives import GradientDistance, layer_weights

    model = lb.build("cnn:3-4-2-1,3-4-2-1", input_shape=photos.shape, classes=photos.num_classes, seed=0)
    x, y = photos.batch(2, seed=0)
    shipped = random_head(model, width=3000, seed=0, train=False)
    clean = lb.observe(shipped, x, y, labels_known=True)
    gen = torch.Generator().manual_seed(0)
    dummy = [torch.randn(g.shape, generator=gen) for g in clean.gradients]
    weights = layer_weights("l0", [clean.params()[n] for n in clean.param_names])

    def objective(obs):
        return float(GradientDistance(obs.gradients, kind="cosine-layer", weights=weights)(dummy))

    def features(obs):
        block = find_block(obs.model)
        return tensor_features(block.first, shared_gradient(obs, block.second), block.act, 2, seed=0, trials=4,
                               refine=20).features

    reference = features(clean)
    norms = [float(g.norm()) for g in clean.gradients]
    for spec in (f"clip:{min(norms) / 2}", f"clip:{min(norms) / 2},layer"):
        clipped = lb.observe(shipped, x, y, labels_known=True, defense=spec)
        assert all(float(c.norm()) < n for c, n in zip(clipped.gradients, norms)), spec  # every tensor shrank
        assert objective(clipped) == pytest.approx(objective(clean), abs=1e-6), spec
        assert (features(clipped) * reference).sum(1).abs().min() > 0.999, spec
    per_sample = lb.observe(shipped, x, y, labels_known=True, defense="dpsgd:1e-4,0")
    assert abs(objective(per_sample) - objective(clean)) > 1e-4


def _rmse(rec, x):
    return lb.compare(rec, x)["rmse"]


@pytest.mark.slow
def test_beats_inverting_gradients_at_batch_4_on_a_small_cnn(photos):
    x, obs = _setup(photos)
    budget = 300
    ig = lb.attack("inverting-gradients", obs, preset="quick", iterations=budget)
    ours = lb.attack("liu2024", obs, preset="quick", iterations=budget)
    assert _rmse(ours, x) < _rmse(ig, x)


@pytest.mark.slow
@pytest.mark.xfail(reason="no robust gain at a CPU budget; every measurement is in docs/feature-attacks.md "
                          "('The feature term').  In short: global and per-layer clipping scale every tensor, which "
                          "App. F's per-tensor cosines and the tensor step cannot see (test above); per-sample "
                          "clipping (dpsgd:C,0), DP-SGD and noise give gains of at most 0.02 RMSE, of either sign, "
                          "at 16 px (where a pure-noise gradient scores like the clean one) and on trained and "
                          "wider models; at 32 px (BN-free convnet-8, batch 4, 500 steps, 20 000-neuron head) "
                          "per-sample clipping does hurt gradient matching (0.336 -> 0.394 on seed 0) and the *true* "
                          "features help under it (0.394/0.432/0.577 -> 0.375/0.427/0.494, seeds 0/1/2), but the "
                          "recovered ones (cosine about 0.85) do not (0.418-0.422; 40 000 neurons: 0.404), and "
                          "with the head every run stays above a flat grey image (0.29/0.23 on seeds 0/1); on a "
                          "linear model, where matching alone recovers the batch (0.008) and clipping breaks it "
                          "(0.175), the true features win back little (0.161) and the recovered ones hurt (0.337) "
                          "(python -m benchmarks feature_term)",
                   strict=False)
def test_feature_term_helps_under_clipping(photos):
    """Liu et al. 2024, Tables 7 vs 8: with the feature term the attack keeps RMSE ≈ 0.16 under clipping, without it
    degrades to 0.19–0.25.  The clipping here is per-sample (DP-SGD without noise, ``dpsgd:C,0`` with C below every
    per-sample norm): global clipping rescales the whole gradient and per-layer clipping (``clip:C,layer``) each
    tensor, which neither the per-tensor cosine nor the tensor step can see (test above), while per-sample factors c_i = C/‖g_i‖ reweight the samples — gradient matching (simulating the
    unclipped gradient) cannot reproduce that, the tensor step only sees re-weighted features.  Per-sample gradients
    need a model without BN in training mode: a BN-free CNN, client in eval mode, no BN prior."""
    model = lb.build("cnn:3-8-2-1,3-8-2-1,3-8-2-1", input_shape=photos.shape, classes=photos.num_classes, seed=0)
    x, y = photos.batch(4, seed=0)
    shipped = random_head(model, width=40_000, seed=0, center="calibration", calibration=_public(photos, x),
                          train=False)
    obs = lb.observe(shipped, x, y, labels_known=True, defense="dpsgd:0.001,0")
    budget = 300
    with_f = lb.attack("liu2024", obs, preset="quick", iterations=budget)
    without = lb.attack("liu2024", obs, preset="quick", iterations=budget, feature=0.0)
    assert _rmse(with_f, x) < _rmse(without, x)


def test_without_feature_term_and_generator_it_is_inverting_gradients(photos):
    """With ``feature=0``, pixels, IG's global cosine and IG's step, the objective and the optimiser are IG's:
    the reconstructions coincide (the ablation baseline the feature term is measured against)."""
    model = lb.build("cnn:3-4-2-1,3-4-2-1", input_shape=photos.shape, classes=photos.num_classes, seed=0)
    x, y = photos.batch(2, seed=0)
    obs = lb.observe(model, x, y, labels_known=True)
    ig = lb.attack("inverting-gradients", obs, preset="fast", iterations=20, seed=3, tv_growth=0.0,
                   features=0.0)  # fast's output-layer features (B ≥ 2) are not App. F's feature term
    ours = lb.attack("liu2024", obs, iterations=20, seed=3, feature=0.0, generator=False, distance="cosine",
                     weights="equal", lr=0.2, step_unit="normalised", init_std=0.4, schedule="cosine", tv=1e-4)
    assert torch.allclose(ours.images, ig.images, atol=1e-6)
    per_tensor = lb.attack("liu2024", obs, iterations=20, seed=3, feature=0.0, generator=False, lr=0.2,
                           step_unit="normalised", init_std=0.4, schedule="cosine", tv=1e-4)
    assert not torch.allclose(per_tensor.images, ig.images, atol=1e-3)  # App. F's per-tensor L_grad differs


def _positive_two_layer(seed, defense=None):
    """A ReLU two-layer net with random Gaussian hidden weights and no hidden bias (the tensor method's block, the
    features are the inputs), on 4 non-negative unit-norm inputs in d = 20."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 20, generator=gen).abs()
    x = x / x.norm(dim=1, keepdim=True)
    y = torch.randint(0, 2, (4,), generator=gen)
    model = lb.build("twolayer:4000", input_shape=(20,), classes=2, act="relu", init="gaussian", bias=False,
                     seed=seed)
    return x, lb.observe(model, x, y, labels_known=True, defense=defense)


def test_feature_term_enters_the_objective_with_a_plus_sign():
    """total − match is +α_f·R_feature (eq. 4): positive away from the features, zero at them."""
    from leakbench.attacks.gradient.liu2024 import Liu2024Matcher
    from leakbench.attacks.solvers.matching_settings import MatchingSettings

    x, obs = _positive_two_layer(0)
    matcher = Liu2024Matcher(obs, MatchingSettings(iterations=1, distance="cosine"), features=x,
                             feature_weight=0.5, form="signed")
    far = torch.rand(4, 20, generator=torch.Generator().manual_seed(5))
    total, match = matcher.objective(far, obs.labels)
    expected = 0.5 * feature_loss(far, x, form="signed")
    assert float(expected) > 0.05 and torch.isclose(total - match, expected)
    total, match = matcher.objective(x, obs.labels)
    assert abs(float(total - match)) < 1e-6


@pytest.mark.slow  # three 100-step attacks on a 4 000-neuron head: `make test-slow`
def test_feature_term_beats_inverting_gradients_under_noise():
    """Where the gradient itself misleads — Gaussian noise σ = 0.1 on every tensor — gradient matching fits the
    noise, while the tensor method averages it over the 4 000 random neurons (Theorem 3.1: error ∝ B·sqrt(d/m)).
    Same pixels, step, box and budget; only α_f differs.  Measured (seeds 0–3): RMSE 0.17/0.17/0.27/0.20 with
    the feature term, 0.25/0.24/0.34/0.27 without, 0.32/0.34/0.40/0.36 for Inverting Gradients."""
    x, obs = _positive_two_layer(0, "noise:0.1")
    pixels = dict(iterations=100, generator=False, lr=0.1, tv=0.0, bn=0.0, distance="cosine", seed=0)
    ig = _rmse(lb.attack("inverting-gradients", obs, iterations=100, tv=0.0, seed=0), x)
    without = _rmse(lb.attack("liu2024", obs, feature=0.0, **pixels), x)
    ours = _rmse(lb.attack("liu2024", obs, feature=0.1, **pixels), x)
    assert ours < without - 0.03 and ours < ig - 0.03, (ours, without, ig)
