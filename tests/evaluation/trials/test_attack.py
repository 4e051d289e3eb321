"""Scoring a targeted attack's trial: the claimed slots, beside a chance control under the same selection."""
from __future__ import annotations

import math

import pytest
import torch

from leakbench.evaluation.trials.attack import targeted_scores


def test_a_targeted_attack_is_scored_on_its_claimed_slots_and_chance_on_its_nearest_originals():
    per_sample = {"rmse": [0.30, 0.05, 0.40, 0.35], "chance_rmse": [0.50, 0.20, 0.45, 0.30]}
    order = [2, 0, 1, 3]                      # original 1 is paired with slot 0, the one claimed
    confidence = torch.tensor([1.0, 0.0, 0.0, 0.0])
    out = targeted_scores(per_sample, order, confidence)
    assert out["targets"] == 1
    assert out["rmse"] == pytest.approx(0.05)
    # the flat image is credited with the original it is nearest to (0.20), not the attack's (also 0.20 here by
    # chance) nor the batch mean: a selection the attack's matching also enjoys
    assert out["chance_rmse"] == pytest.approx(0.20)
    assert out["psnr"] == pytest.approx(-20 * math.log10(0.05))


def test_the_chance_control_takes_as_many_nearest_originals_as_there_are_claims():
    per_sample = {"rmse": [0.1, 0.1, 0.9], "chance_rmse": [0.5, 0.3, 0.1]}
    out = targeted_scores(per_sample, [0, 1, 2], torch.tensor([1.0, 1.0, 0.0]))
    assert out["targets"] == 2
    assert out["chance_rmse"] == pytest.approx(math.sqrt((0.1 ** 2 + 0.3 ** 2) / 2))


def test_no_claimed_slot_leaves_the_batch_scores():
    out = targeted_scores({"rmse": [0.2], "chance_rmse": [0.3]}, [0], torch.tensor([0.0]))
    assert out == {"targets": 0}
