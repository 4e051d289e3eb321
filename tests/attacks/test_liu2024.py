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


def _setup(photos, *, defense=None, seed=0):
    """ConvNet-8 (BN, training mode, statistics granted as in Liu et al. Sec. 5.1) + the random head,
    its input centred on public images (``center="calibration"``: random-CNN features are nearly collinear)."""
    model = lb.build("convnet-8", input_shape=photos.shape, classes=photos.num_classes, seed=seed)
    x, y = photos.batch(4, seed=seed)
    shipped = random_head(model, width=40_000, seed=seed, center="calibration", calibration=_public(photos, x))
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
    x, obs = _setup(photos)
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


def test_bad_options():
    with pytest.raises(lb.ConfigError, match="feature_form"):
        lb.attacks.create("liu2024", feature_form="l2")
    with pytest.raises(lb.ConfigError, match="weights"):
        lb.attacks.create("liu2024", weights="l1")
    with pytest.raises(lb.ConfigError, match="block_weight"):
        lb.attacks.create("liu2024", block_weight="none")


def test_signed_form_tells_a_feature_from_its_mirror():
    gen = torch.Generator().manual_seed(2)
    z = torch.nn.functional.normalize(torch.randn(3, 12, generator=gen), dim=1)
    assert float(feature_loss(2.0 * z[[1, 2, 0]], z, form="signed")) < 1e-6
    assert float(feature_loss(-z[:1], z[:1], form="signed")) > 1.99  # one feature: its mirror costs 2
    assert float(feature_loss(-z, z, form="signed")) > 1.0          # a batch of mirrors: > 1 whatever the matching
    assert float(feature_loss(-z, z, form="cosine")) < 1e-6         # the paper's squared cosine cannot tell


def test_block_weights_of_the_random_head(photos):
    from leakbench.attacks.gradient.liu2024 import tensor_weights
    _, obs = _setup(photos)
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
    from leakbench.attacks.objectives import GradientDistance, layer_weights

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
@pytest.mark.xfail(reason="no robust gain at a CPU budget (16 px photos, centred 40 000-neuron head, labels known, "
                          "attack seed 0 unless noted; RMSE with α_f = 0.1 vs without, data seeds 0/1/2[/3/4/5]). "
                          "Global and per-layer clipping (clip:C, clip:C,layer) cannot matter: both scale every "
                          "tensor, and L_grad is per-tensor cosines (App. F) — clip:2,layer at batch 4 gives "
                          "0.332/0.301/0.408 vs 0.340/0.297/0.413, the no-defense numbers up to float chaos. "
                          "Per-sample clipping (dpsgd:0.001,0, C below every per-sample norm, no noise), "
                          "cnn:3-8-2-1,3-8-2-1,3-8-2-1: batch 4, 300 it. 0.338/0.308/0.411 vs 0.332/0.321/0.409 "
                          "(no defense 0.335/0.299/0.408 vs 0.339/0.298/0.413); batch 4, 1000 it. "
                          "0.315/0.267/0.383/0.321/0.285/0.196 vs 0.317/0.289/0.392/0.317/0.286/0.195 (no defense "
                          "0.318/0.263/0.389 vs 0.308/0.258/0.398); batch 8, 300 it. "
                          "0.353/0.307/0.342/0.347/0.327/0.307 vs 0.374/0.316/0.362/0.346/0.320/0.293, attack seed 1 "
                          "0.328/0.276/0.323 vs 0.325/0.271/0.333 (no defense 0.354/0.336/0.345 vs 0.359/0.316/0.334; "
                          "α_f = 0.5: 0.371/0.331/0.337); the same cnn trained (300 Adam steps, per-sample norms "
                          "0.03–4400), batch 8: 0.298/0.236/0.312 vs 0.288/0.263/0.301 (no defense "
                          "0.308/0.259/0.347 vs 0.333/0.219/0.321); 128-dim features "
                          "(cnn:3-16-2-1,3-32-2-1,3-32-2-1), batch 4, 300 it.: "
                          "0.302/0.259/0.394/0.341/0.294/0.186 vs 0.310/0.269/0.410/0.359/0.285/0.184, attack seed 1 "
                          "0.299/0.237/0.345 vs 0.287/0.251/0.341.  Gains, where they appear, are 0.001–0.02 while "
                          "the attack seed alone moves the RMSE by up to 0.05: per-sample clipping barely hurts "
                          "gradient matching here (Table 8's 0.16 → 0.21–0.23 needs a setting where it does).  Earlier, no "
                          "gain either: convnet-8 in eval mode (dpsgd:0.5,0) 0.319/0.343/0.457 vs 0.322/0.339/0.447, "
                          "the trained cnn at batch 4 0.286/0.277/0.264 vs 0.288/0.277/0.268.  Breaching's "
                          "per_example_clipping (each example alone through convnet-8 in training mode, BN on one "
                          "sample, C = 0.001; a scratch observation, not a registered defense), batch 4: "
                          "0.365/0.409/0.442 vs 0.338/0.363/0.444 (no defense 0.339/0.397/0.445 vs 0.326/0.370/0.451).  "
                          "Why: in this setting the gradient barely matters — without the term, a pure-noise gradient "
                          "(noise:10) scores .311/.276/.409/.320/.281 on data seeds 0–4, like the clean one and like a "
                          "flat grey image (.292/.309/.379/.323/.305), while the tensor step recovers the features "
                          "(best |cos| 0.98–0.997 under dpsgd:0.001,0.003/0.01 and noise:0.001); DP-SGD and plain noise "
                          "show no robust gain either (wins 0–5/5 by ≤ 0.02, varying with the attack seed).  The ablation "
                          "needs a setting where gradient matching beats the grey image first",
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
