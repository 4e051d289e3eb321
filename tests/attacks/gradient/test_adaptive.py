"""The adaptive attacks: they know the defense, their objective is zero at the truth, and they win where theory says."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks import attack_tags, create
from leakbench.attacks.gradient.adaptive import (
    MaskedMatcher,
    TopKAdaptive,
    SoteriaAdaptive,
    coefficients,
    mixup_structure,
    unmix,
)
from leakbench.attacks.solvers.gradient_matching import GradientMatcher
from leakbench.errors import UnsupportedThreatModel

ADAPTIVE = {"soteria-adaptive": "soteria", "topk-adaptive": "topk", "mixup-adaptive": "mixup",
            "instahide-carlini": "instahide", "precode-adaptive": "precode", "ats-adaptive": "ats"}


@pytest.fixture(scope="module")
def digits():
    data = lb.load("digits")
    model = lb.build("cnn:3-8-1-1,3-8-2-1", input_shape=data.shape, classes=10, act="tanh", seed=0)
    return data, model


@pytest.mark.parametrize("name", sorted(ADAPTIVE))
def test_every_adaptive_attack_says_so_and_what_it_adapts_to(name):
    assert "adaptive" in attack_tags(name)
    assert create(name, preset="quick").adapts_to == (ADAPTIVE[name],)


@pytest.mark.parametrize("name", sorted(ADAPTIVE))
def test_an_adaptive_attack_refuses_another_defense(digits, name):
    data, model = digits
    x, y = data.batch(2, seed=0)
    obs = lb.observe(model, x, y, labels_known=True, defense="noise:0.01", seed=0)
    with pytest.raises(UnsupportedThreatModel, match=ADAPTIVE[name]):
        lb.attack(name, obs, preset="quick", iterations=2)


@pytest.mark.parametrize("spec, cls", [("soteria:0.5", SoteriaAdaptive), ("topk:0.05", TopKAdaptive)])
def test_the_truth_minimises_the_adaptive_objective_only(digits, spec, cls):
    """Soteria and top-k (a fresh round: e_0 = 0) leave the sent entries exact, so the masked distance of the true
    batch is 0; the plain distance of the true batch is not: a non-adaptive attack is pulled away from the truth."""
    data, model = digits
    x, y = data.batch(2, seed=3)
    obs = lb.observe(model, x, y, labels_known=True, defense=spec, seed=0)
    attack = cls(preset="quick")
    masked = MaskedMatcher(obs, attack.options, attack.masks(obs))
    plain = GradientMatcher(obs, attack.options)
    with torch.enable_grad():
        adaptive_value = float(masked.objective(x, y)[1].detach())
        plain_value = float(plain.objective(x, y)[1].detach())
    assert adaptive_value < 1e-6 < 1e-3 < plain_value


def test_soteria_adaptive_beats_the_non_adaptive_attack(digits):
    data, model = digits
    x, y = data.batch(1, seed=5)
    obs = lb.observe(model, x, y, labels_known=True, defense="soteria:0.5", seed=0)
    scores = {name: lb.compare(lb.attack(name, obs, preset="quick", iterations=120, seed=0), x, y)["psnr"]
              for name in ("inverting-gradients", "soteria-adaptive")}
    assert scores["soteria-adaptive"] > scores["inverting-gradients"] + 3, scores


def test_unmixing_with_exact_labels_recovers_the_batch():
    """Stage 2–3 of mixup-adaptive: exact soft labels of distinct labels give M exactly, and M⁻¹ the images."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 1, 5, 5, generator=g)
    labels = torch.tensor([2, 0, 7, 5])
    lam, perm = 0.7, torch.tensor([1, 0, 3, 2])
    m_true = lam * torch.eye(4, dtype=torch.float64) + (1 - lam) * torch.eye(4, dtype=torch.float64)[perm]
    onehot = torch.nn.functional.one_hot(labels, 10).to(torch.float64)
    m = coefficients(m_true @ onehot, labels, 10)
    assert torch.allclose(m, m_true)
    projected, lam_hat = mixup_structure(m)
    assert abs(lam_hat - lam) < 1e-9 and torch.allclose(projected, m_true)
    mixed = (m_true.float() @ x.reshape(4, -1)).reshape(x.shape)
    assert torch.allclose(unmix(mixed, m, 1e-9), x, atol=1e-4)
