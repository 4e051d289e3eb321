"""Univariate candidate set (provable-attacks paper, Thm. 3.1–3.4) on exact and trained networks."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks.trained.univariate import candidate_set, piecewise_linear
from leakbench.errors import UnsupportedThreatModel
from leakbench.models import TwoLayer
from leakbench.models.targets import train_target
from leakbench.threat import observe_weights


pytestmark = pytest.mark.usefixtures("one_thread")


def _net(w, b, v) -> TwoLayer:
    net = TwoLayer(1, len(w), 1).double()
    with torch.no_grad():
        net.first.weight.copy_(torch.tensor(w, dtype=torch.float64)[:, None])
        net.first.bias.copy_(torch.tensor(b, dtype=torch.float64))
        net.second.weight.copy_(torch.tensor(v, dtype=torch.float64)[None])
    return net


def test_pieces_reproduce_the_network():
    g = torch.Generator().manual_seed(0)
    w, b, v = (torch.randn(30, generator=g, dtype=torch.float64) for _ in range(3))
    net = _net(w.tolist(), b.tolist(), v.tolist())
    p, slope, intercept = piecewise_linear(w, b, v)
    xs = torch.linspace(-6, 6, 401, dtype=torch.float64)
    k = torch.searchsorted(p, xs)  # piece index of each x
    assert torch.allclose(slope[k] * xs + intercept[k], net(xs[:, None]).reshape(-1).detach(), atol=1e-10)


def test_single_neuron_recovers_its_training_point():
    # Thm. 3.1: N(x) = relu(2x − 1) reaches the margin 1 only at the training point x = 1
    obs = observe_weights(_net([2.0], [-1.0], [1.0]), input_shape=(1,), margin=1.0)
    rec = lb.attack("univariate", obs, tol=0.0)
    assert rec.images.reshape(-1).tolist() == [1.0]


def test_two_plateaus_give_the_ends_of_the_piece_between():
    # plateau +1 on (−∞, 0], line 1 − 2x on [0, 1], plateau −1 on [1, ∞): Thm. 3.3 → {0, 1}
    p, s, c = piecewise_linear(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1.0, 0.0, -1.0]),
                               torch.tensor([1.0, -2.0, 2.0]))
    cand, info = candidate_set(p, s, c, 1.0, tol=0.0)
    assert cand.tolist() == [0.0, 1.0] and info["source"] == ["thm3.3", "thm3.3"]


def test_two_sloped_pieces_give_their_margin_crossings():
    # 1 on (−∞, 0], 1 − x on [0, ½], x on [½, 1], 1 on [1, ∞): Thm. 3.2 on the middle pair → {0, 1}
    p, s, c = piecewise_linear(torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.tensor([1.0, 0.0, -0.5, -1.0]),
                               torch.tensor([1.0, -1.0, 2.0, -1.0]))
    cand, info = candidate_set(p, s, c, 1.0, tol=0.0)
    assert cand.tolist() == [0.0, 1.0] and set(info["source"]) == {"thm3.2"}


def test_trained_net_candidate_set_holds_a_quarter_training_points():
    # 6 points in [−2, 2], random labels; a two-layer ReLU net of width 100 trained with the
    # logistic loss towards the max-margin direction; the margin is granted (Sec. 3 assumes it).
    g = torch.Generator().manual_seed(1)
    x = torch.rand(6, 1, generator=g, dtype=torch.float64) * 4 - 2
    y = (torch.rand(6, generator=g) > 0.5).long()
    target = train_target(x, y, model="twolayer:100", loss="logistic", lr=0.1, steps=6000, loss_tol=0,
                          center=False, init="uniform", init_scale=0.3, seed=1)
    margin = float(target.margins().min())
    assert margin > 0
    rec = lb.attack("univariate", observe_weights(target, margin=margin), tol=1e-2)
    cand = rec.images.reshape(-1)
    hits = (cand[:, None] - x[:, 0][None]).abs().min(1).values <= 0.02  # within 0.5 % of the input range
    # chance: a candidate uniform on [−2, 2] lands within 0.02 of a training point with probability
    # (length of the union of the 6 windows) / 4 ≈ 0.06
    grid = torch.linspace(-2, 2, 400_001, dtype=x.dtype)
    chance = float(((grid[:, None] - x[:, 0][None]).abs().min(1).values <= 0.02).double().mean())
    assert chance < 0.07 and hits.float().mean() >= max(0.25, 3 * chance)


def test_requirements():
    bad = observe_weights(lb.build("twolayer:5", (2,), 1, seed=0))
    with pytest.raises(UnsupportedThreatModel, match="one input feature"):
        lb.attack("univariate", bad, margin=1.0)
    no_margin = observe_weights(lb.build("twolayer:5", (1,), 1, seed=0))
    with pytest.raises(UnsupportedThreatModel, match="margin"):
        lb.attack("univariate", no_margin)
    x, y = torch.randn(2, 1), torch.tensor([0, 1])
    grad_obs = lb.observe(lb.build("twolayer:5", (1,), 2, seed=0), x, y)
    with pytest.raises(UnsupportedThreatModel, match="trained weights"):
        lb.attack("univariate", grad_obs, margin=1.0)
