"""Training losses: each equals an independent computation written out here."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from leakbench.errors import ConfigError
from leakbench.losses import LOSSES, cross_entropy, exponential, get_loss, logistic, mse


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.fixture
def labels() -> torch.Tensor:
    return torch.tensor([0, 4, 2, 2, 1, 3])


def test_registry_maps_names_to_the_functions():
    assert get_loss("ce") is cross_entropy
    assert get_loss("mse") is mse
    assert get_loss("logistic") is logistic
    assert get_loss("exponential") is exponential
    assert LOSSES.names() == ["ce", "exponential", "logistic", "mse"]


def test_cross_entropy_on_indices_equals_torch(logits, labels):
    expected = F.cross_entropy(logits, labels)
    assert torch.allclose(cross_entropy(logits, labels), expected, rtol=1e-12, atol=0)
    # by hand: mean over the batch of −log softmax at the label
    by_hand = sum(-(logits[i, labels[i]] - torch.logsumexp(logits[i], 0)) for i in range(6)) / 6
    assert torch.allclose(cross_entropy(logits, labels), by_hand, rtol=1e-12, atol=0)
    # int32 labels are indices too
    assert torch.allclose(cross_entropy(logits, labels.int()), expected, rtol=1e-12, atol=0)


def test_soft_target_cross_entropy_equals_hard_on_one_hot(logits, labels):
    soft = F.one_hot(labels, 5).to(logits.dtype)
    assert torch.allclose(cross_entropy(logits, soft), cross_entropy(logits, labels), rtol=1e-12, atol=0)


def test_soft_target_cross_entropy_equals_torch_probabilities(logits):
    target = torch.softmax(torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), -1)
    expected = -(target * torch.log_softmax(logits, -1)).sum(1).mean()
    assert torch.allclose(cross_entropy(logits, target), expected, rtol=1e-12, atol=0)
    assert torch.allclose(cross_entropy(logits, target), F.cross_entropy(logits, target), rtol=1e-12, atol=0)


def test_mse_against_one_hot_by_hand(logits, labels):
    total = 0.0
    for i in range(6):
        for k in range(5):
            t = 1.0 if k == int(labels[i]) else 0.0
            total += (float(logits[i, k]) - t) ** 2
    assert mse(logits, labels).item() == pytest.approx(total / 6, rel=1e-12)
    # summed over classes, averaged over the batch: K times F.mse_loss (which averages both)
    assert mse(logits, labels).item() == pytest.approx(5 * F.mse_loss(logits, F.one_hot(labels, 5).double()).item(),
                                                       rel=1e-12)


def test_mse_soft_targets_equal_one_hot_indices(logits, labels):
    assert torch.allclose(mse(logits, F.one_hot(labels, 5).double()), mse(logits, labels), rtol=1e-12, atol=0)
    soft = torch.full((6, 5), 0.2, dtype=torch.float64)
    assert mse(logits, soft).item() == pytest.approx(((logits - 0.2) ** 2).sum().item() / 6, rel=1e-12)


@pytest.mark.parametrize("shape", [(4, 1), (4,)])
def test_logistic_and_exponential_by_hand_with_01_and_pm1_labels(shape):
    f = torch.tensor([0.3, -1.2, 2.5, -0.1], dtype=torch.float64).reshape(shape)
    y01 = torch.tensor([1, 0, 0, 1])
    ypm = torch.tensor([1.0, -1.0, -1.0, 1.0])
    flat = f.reshape(-1).tolist()
    signs = [1, -1, -1, 1]
    log_hand = sum(math.log(1 + math.exp(-s * v)) for s, v in zip(signs, flat)) / 4
    exp_hand = sum(math.exp(-s * v) for s, v in zip(signs, flat)) / 4
    for y in (y01, ypm):
        assert logistic(f, y).item() == pytest.approx(log_hand, rel=1e-12)
        assert exponential(f, y).item() == pytest.approx(exp_hand, rel=1e-12)
    # a (B, 1) label column works as well
    assert logistic(f, y01.reshape(4, 1)).item() == pytest.approx(log_hand, rel=1e-12)


def test_logistic_is_stable_for_large_margins():
    f = torch.tensor([[800.0], [-800.0]], dtype=torch.float64)
    y = torch.tensor([0, 1])  # both badly wrong: loss = |f|
    assert logistic(f, y).item() == pytest.approx(800.0, rel=1e-12)
    assert logistic(-f, y).item() == pytest.approx(0.0, abs=1e-300)


@pytest.mark.parametrize("name", ["ce", "mse", "logistic", "exponential"])
def test_losses_are_means_over_the_batch(name):
    gen = torch.Generator().manual_seed(3)
    k = 1 if name in ("logistic", "exponential") else 4
    out = torch.randn(6, k, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2 if k == 1 else k, (6,), generator=gen)
    fn = get_loss(name)
    per_sample = torch.stack([fn(out[i:i + 1], y[i:i + 1]) for i in range(6)])
    assert fn(out, y).item() == pytest.approx(per_sample.mean().item(), rel=1e-12)
    assert fn(out, y).dim() == 0


@pytest.mark.parametrize("name", ["ce", "mse", "logistic", "exponential"])
def test_gradients_flow_to_outputs(name):
    k = 1 if name in ("logistic", "exponential") else 3
    out = torch.randn(4, k, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 1, 0])
    assert torch.autograd.gradcheck(lambda o: get_loss(name)(o, y), (out,))


def test_unknown_loss_name_lists_the_known_ones():
    with pytest.raises(ConfigError) as info:
        get_loss("cross-entropy")
    msg = str(info.value)
    assert "unknown loss 'cross-entropy'" in msg
    assert "Known losses: ce, exponential, logistic, mse" in msg
    with pytest.raises(ConfigError, match="Did you mean 'mse'"):
        get_loss("mse2")
