"""Neurons at a sample's hinge: the side that the observed gradient fits, where the sample's precision cannot tell."""
import torch
from torch import nn

from leakbench.attacks.solvers.hinge import hinge_deltas
from leakbench.attacks.solvers.peeling import SampleGradients


def _setting(batch=6, inputs=20, width=50, classes=4, seed=0):
    """A ReLU MLP (float64) whose neuron 7 sits 1e-9 above sample 2's hinge, the batch's gradient, and an estimate
    of the batch 1e-9 off that puts the sample on the inactive side there."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, inputs, generator=g, dtype=torch.float64)
    w = torch.randn(width, inputs, generator=g, dtype=torch.float64) / inputs ** 0.5
    b = torch.randn(width, generator=g, dtype=torch.float64) * 0.1
    b[7] = 1e-9 - float(x[2] @ w[7])
    rest = nn.Sequential(nn.ReLU(), nn.Linear(width, classes)).double()
    torch.nn.init.normal_(rest[1].weight, generator=g)
    grads = SampleGradients(rest, w, b, "ce", batch, classes)
    y = torch.arange(batch) % classes
    delta = grads(x, y)
    x_hat = x.clone()
    x_hat[2] -= 2e-9 * w[7] / w[7].pow(2).sum()                   # z = −1e-9 on neuron 7, nearly nothing elsewhere
    return grads, x, x_hat, y, delta.T @ x, delta.sum(0), delta


def test_the_gradient_sets_the_side_of_a_neuron_at_the_hinge():
    grads, x, x_hat, y, target_w, target_b, truth = _setting()
    own = grads(x_hat, y)
    assert own[2, 7] == 0 and truth[2, 7] != 0                    # x̂'s own side is wrong there
    deltas, flipped = hinge_deltas(grads, x_hat, y, target_w, target_b, reach=1e-6)
    assert flipped == 1
    assert torch.allclose(deltas, truth, rtol=0, atol=1e-9)   # δ at the hinge itself, not 1e-9 above
    before = (target_w - own.T @ x_hat).norm() / target_w.norm()
    after = (target_w - deltas.T @ x_hat).norm() / target_w.norm()
    assert before > 1e-3 and after < 1e-8


def test_outside_the_reach_and_where_the_side_is_right_nothing_moves():
    grads, x, x_hat, y, target_w, target_b, truth = _setting(seed=1)
    deltas, flipped = hinge_deltas(grads, x_hat, y, target_w, target_b, reach=1e-14)   # 1e-9 is beyond this reach
    assert flipped == 0 and torch.equal(deltas, grads(x_hat, y))
    deltas, flipped = hinge_deltas(grads, x, y, target_w, target_b, reach=1e-3)        # the true batch: every side right
    assert flipped == 0 and torch.equal(deltas, truth)
