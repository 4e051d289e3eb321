"""LiRA, RMIA and the loss baseline with reference models (Carlini et al. 2022; Zarifzadeh et al. 2024; Yeom et al.)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import special, stats

import leakbench as lb
from leakbench.attacks.membership import (MEMBERSHIP_ATTACKS, ReferenceOutputs, lira_scores, logit_confidence,
                                          rmia_scores)
from leakbench.attacks.membership.reference import loss_scores, rmia_marginal
from leakbench.errors import ConfigError
from leakbench.evaluation.membership.reference import (Recipe, half_masks, membership_rows, run_membership_attacks,
                                                       target_on_half, train_reference_models)
from leakbench.threat import observe_weights

pytestmark = pytest.mark.usefixtures("one_thread")


def _hand_made(seed=0, k=8, n=6, c=4):
    g = np.random.default_rng(seed)
    logits = g.normal(0, 3, size=(k, n, c))
    labels = g.integers(0, c, size=n)
    target = g.normal(0, 3, size=(n, c))
    mask = np.zeros((k, n), dtype=bool)
    for j in range(n):
        mask[g.permutation(k)[: k // 2], j] = True
    return logits, labels, target, mask


def _phi_naive(logits, labels):
    p = special.softmax(logits, axis=-1)
    py = np.take_along_axis(p, labels[..., None] if p.ndim == 2 else np.broadcast_to(labels, p.shape[:-1])[..., None],
                            -1)[..., 0]
    return np.log(py / (1 - py))


def test_logit_confidence_is_log_odds_and_stable():
    logits, labels, target, _ = _hand_made()
    phi = logit_confidence(torch.tensor(target), torch.tensor(labels)).numpy()
    np.testing.assert_allclose(phi, _phi_naive(target, labels), rtol=1e-9, atol=1e-9)
    # far into the tails p_y rounds to 1 (or 0) in float64; φ stays exact
    extreme = logit_confidence(torch.tensor([[800.0, 0.0, -5.0], [-900.0, 0.0, 0.0]]), torch.tensor([0, 0]))
    assert torch.isfinite(extreme).all() and extreme[0] == pytest.approx(800 - math.log1p(math.exp(-5))) and extreme[1] < -899
    binary = logit_confidence(torch.tensor([[2.0], [2.0]]), torch.tensor([1, 0]))
    assert binary.tolist() == [2.0, -2.0]
    # the loss baseline is −CE
    ce = torch.nn.functional.cross_entropy(torch.tensor(target), torch.tensor(labels), reduction="none").numpy()
    np.testing.assert_allclose(loss_scores(phi), -ce, rtol=1e-9)


def test_lira_matches_scipy_normal_fits():
    logits, labels, target, mask = _hand_made()
    ref = _phi_naive(logits, labels)          # K×N
    obs = _phi_naive(target, labels)          # N
    online = lira_scores(obs, ref, mask, online=True)
    offline = lira_scores(obs, ref, mask, online=False)
    for j in range(obs.size):
        mu_in, sd_in = stats.norm.fit(ref[mask[:, j], j])
        mu_out, sd_out = stats.norm.fit(ref[~mask[:, j], j])
        lr = stats.norm.pdf(obs[j], mu_in, sd_in) / stats.norm.pdf(obs[j], mu_out, sd_out)
        assert online[j] == pytest.approx(math.log(lr), rel=1e-7, abs=1e-7)
        assert offline[j] == pytest.approx(-math.log(stats.norm.sf(obs[j], mu_out, sd_out)), rel=1e-7, abs=1e-9)
    # global variance: one σ_in and one σ_out, the pooled deviations from each example's own mean
    pooled = lira_scores(obs, ref, mask, online=True, global_variance=True)
    res_in = np.concatenate([ref[mask[:, j], j] - ref[mask[:, j], j].mean() for j in range(obs.size)])
    res_out = np.concatenate([ref[~mask[:, j], j] - ref[~mask[:, j], j].mean() for j in range(obs.size)])
    s_in, s_out = np.sqrt((res_in ** 2).mean()), np.sqrt((res_out ** 2).mean())
    for j in range(obs.size):
        want = (stats.norm.logpdf(obs[j], ref[mask[:, j], j].mean(), s_in)
                - stats.norm.logpdf(obs[j], ref[~mask[:, j], j].mean(), s_out))
        assert pooled[j] == pytest.approx(want, rel=1e-9)


def test_lira_offline_does_not_saturate_far_in_the_tail():
    ref = np.zeros((4, 2))
    scores = lira_scores(np.array([40.0, 60.0]), ref + np.array([[0.1], [-0.1], [0.1], [-0.1]]),
                         np.zeros((4, 2), bool), online=False)
    assert np.isfinite(scores).all() and scores[1] > scores[0]  # Pr[Z < φ] is 1.0 for both in float64


@pytest.mark.parametrize("online", [True, False])
def test_rmia_matches_pairwise_likelihood_ratios(online):
    logits, labels, target, mask = _hand_made(seed=1, k=4, n=7)
    zlogits, zlabels, ztarget, zmask = _hand_made(seed=2, k=4, n=11)
    a, gamma = 0.4, 1.5
    scores = rmia_scores(_phi_naive(target, labels), _phi_naive(logits, labels), mask,
                         _phi_naive(ztarget, zlabels), _phi_naive(zlogits, zlabels), zmask, online=online, a=a,
                         gamma=gamma)

    def prob(lg, lb_):  # p_y per model and point, straight from the softmax
        return np.take_along_axis(special.softmax(lg, -1), np.broadcast_to(lb_, lg.shape[:-1])[..., None], -1)[..., 0]

    def marginal(p_ref, m):
        if online:
            return p_ref.mean(0)
        out = np.array([p_ref[~m[:, j], j].mean() for j in range(p_ref.shape[1])])
        return 0.5 * ((1 + a) * out + (1 - a))

    px = prob(target, labels) / marginal(prob(logits, labels), mask)
    pz = prob(ztarget, zlabels) / marginal(prob(zlogits, zlabels), zmask)
    want = (px[:, None] / pz[None, :] >= gamma).mean(1)
    np.testing.assert_allclose(scores, want)
    np.testing.assert_allclose(rmia_marginal(_phi_naive(logits, labels), mask, online=True),
                               prob(logits, labels).mean(0))


def test_registry_and_requirements():
    assert {"membership-margin", "membership-lira", "membership-rmia", "membership-loss"} <= set(MEMBERSHIP_ATTACKS)
    with pytest.raises(ConfigError):
        MEMBERSHIP_ATTACKS.create("membership-rmia", gamma=0)
    model = lb.build("mlp:8", input_shape=(1, 8, 8), classes=10, seed=0)
    obs = observe_weights(model, input_shape=(1, 8, 8))
    x, y = torch.rand(5, 1, 8, 8), torch.arange(5)
    with pytest.raises(ConfigError, match="ReferenceOutputs"):
        MEMBERSHIP_ATTACKS.create("membership-lira")(obs, x, labels=y)
    ref = ReferenceOutputs(torch.zeros(2, 5), torch.tensor([[1, 0, 1, 0, 1], [0, 1, 0, 1, 0]]))
    res = MEMBERSHIP_ATTACKS.create("membership-lira", online=False)(obs, x, labels=y, reference=ref)
    assert res.scores.shape == (5,) and res.info["global_variance"] is True


def test_half_masks_are_complementary_pairs():
    m = half_masks(11, 5, seed=3)
    assert m.shape == (5, 11) and (m.sum(1) == 5).all()
    assert not (m[0] & m[1]).any() and not (m[2] & m[3]).any()
    assert torch.equal(m, half_masks(11, 5, seed=3)) and not torch.equal(m, half_masks(11, 5, seed=4))


@pytest.fixture(scope="module")
def overfit():
    """An MLP trained to ~zero loss on 500 digits (half of a 1 000-point pool), and 8 reference models."""
    data = lb.load("digits")
    pool = data.subset(torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:1000])
    recipe = Recipe("mlp:128", epochs=60, batch_size=32, lr=0.2)
    target, members, run = target_on_half(recipe, pool, seed=0)
    refs = train_reference_models(recipe, pool, count=8, seed=0, cache_dir=False)
    return pool, recipe, target, members, run, refs


def test_reference_models_record_seeds_masks_and_cache(overfit, tmp_path):
    pool, recipe, _, _, _, refs = overfit
    assert refs.count == 8 and len(set(refs.seeds)) == 8 and refs.in_mask.shape == (8, 1000)
    assert (refs.in_mask.sum(0) == 4).all()  # every point IN for exactly half of the models
    small = pool.subset(torch.arange(40))
    quick = Recipe("mlp:8", epochs=1, batch_size=10, lr=0.1)
    first = train_reference_models(quick, small, count=2, seed=1, cache_dir=tmp_path)
    again = train_reference_models(quick, small, count=2, seed=1, cache_dir=tmp_path)
    assert not first.cached and again.cached and again.seeds == first.seeds
    torch.testing.assert_close(again.phi, first.phi)
    torch.testing.assert_close(again.outputs_on(small.images, small.labels).phi, first.phi)


def test_lira_and_rmia_beat_the_loss_baseline_on_an_overfit_target(overfit):
    pool, _, target, members, run, refs = overfit
    assert run.train_loss < 0.05
    attacks = {"loss": ("membership-loss", {}), "lira": ("membership-lira", {"online": True}),
               "lira-offline": ("membership-lira", {"online": False}), "rmia": ("membership-rmia", {})}
    rows = {r.attack: r for r in membership_rows(run_membership_attacks(target, pool, refs, attacks), members,
                                                 fprs=(0.05, 0.02, 0.01))}
    assert rows["loss"].nonmembers == 500 and rows["loss"].tpr[0.01] is None  # 1 % needs 1 000 non-members
    assert rows["loss"].tpr_text(0.01) == "not measurable at n = 500"
    for name in ("lira", "lira-offline", "rmia"):
        assert rows[name].tpr[0.02] > rows["loss"].tpr[0.02], name
        assert rows[name].auc.mean > rows["loss"].auc.mean, name
