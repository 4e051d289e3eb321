"""LOKI (Zhao et al. 2024): exact recovery of every client's lone samples under the secure sum, and its limits."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.errors import UnsupportedThreatModel
from leakbench.models.loki import loki


@pytest.fixture(scope="module")
def digits():
    return lb.load("digits")


def _setup(digits, clients=4, bins=128):
    model = lb.build("mlp:64", input_shape=digits.shape, classes=10, seed=0, act="relu")
    shipped = loki(model, clients=clients, bins=bins, calibration=digits.images[-256:])
    return shipped, digits.subset(torch.arange(32, len(digits.images) - 256))


def _exact(images, x, tol=1e-4):
    r = images.reshape(images.shape[0], -1).double()
    f = x.reshape(x.shape[0], -1).double()
    return (r[None] - f[:, None]).abs().amax(-1).min(1).values < tol


def _lone(block, x):
    """Which samples are alone in their bin (the block's own bin assignment)."""
    bins = block.bin_of(x)
    return (bins[:, None] == bins[None]).sum(1) == 1


def test_every_clients_lone_samples_are_recovered_exactly_from_the_secure_sum(digits):
    shipped, population = _setup(digits)
    x, y = digits.images[:32], digits.labels[:32]
    obs = lb.observe(shipped, x, y, defense="secagg:4", population=population, seed=3)
    rec = lb.attack("loki", obs)
    assert rec.batch_size == 4 * 32
    block = obs.model.loki
    from leakbench.defenses.pipeline import other_batches

    others = other_batches(population, 3, 32, like_x=x, like_y=y, generator=torch.Generator().manual_seed(3))
    for xb in [x, *[o[0] for o in others]]:
        lone = _lone(block, xb)
        exact = _exact(rec.images, xb)
        assert lone.sum() >= 16
        assert torch.equal(exact & lone, lone)       # theory: every lone sample exactly
    flagged = rec.images[rec.confidence.bool()].reshape(-1, 64)
    union = torch.cat([x, *[o[0] for o in others]]).reshape(-1, 64)
    assert (flagged[:, None] - union[None]).abs().amax(-1).min(1).values.max() < 1e-4  # every flag is a sample
    alone = sum(int(_lone(block, xb).sum()) for xb in [x, *[o[0] for o in others]])
    assert 0.95 * alone <= rec.trace["lone"] <= alone  # float32 round-off may leave a lone bin unproven, never a blend
    assert rec.trace["per_client"] == [int(len(set(block.bin_of(xb).tolist()))) for xb in
                                       [x, *[o[0] for o in others]]]


def test_without_secure_aggregation_only_the_clients_own_block_is_read(digits):
    shipped, _ = _setup(digits)
    x, y = digits.images[:16], digits.labels[:16]
    rec = lb.attack("loki", lb.observe(shipped, x, y))
    assert rec.batch_size == 16 and rec.trace["per_client"][1:] == []
    assert _exact(rec.images, x)[_lone(shipped.loki, x)].all()


def test_one_imprint_block_for_all_clients_recovers_fewer_of_the_target_under_the_sum(digits):
    """The control: Robbing the Fed's single imprint block (same bins) mixes the 4 clients in its bins."""
    from leakbench.models.malicious import imprint

    shipped, population = _setup(digits)
    model = lb.build("mlp:64", input_shape=digits.shape, classes=10, seed=0, act="relu")
    plain = imprint(model, bins=128, calibration=digits.images[-256:])
    x, y = digits.images[:32], digits.labels[:32]
    got = {}
    for name, ship in (("loki", shipped), ("robbing-the-fed", plain)):
        obs = lb.observe(ship, x, y, defense="secagg:4", population=population, seed=3)
        got[name] = int(_exact(lb.attack(name, obs).images, x).sum())
    assert got["loki"] > got["robbing-the-fed"] + 4


def test_fedavg_local_steps_still_give_samples_of_the_target(digits):
    shipped, population = _setup(digits, bins=256)
    x, y = digits.images[:32], digits.labels[:32]
    obs = lb.observe(shipped, x, y, defense="secagg:4+local:1,0.05,8", population=population, seed=0)
    rec = lb.attack("loki", obs)
    assert torch.isfinite(rec.images).all()
    assert int(_exact(rec.images, x, tol=1e-2).sum()) >= 4
    assert rec.confidence.sum() == 0 and "no slot is provably alone" in rec.trace["lone_check"]


def test_a_model_without_the_block_is_refused(digits):
    model = lb.build("mlp:64", input_shape=digits.shape, classes=10, seed=0)
    obs = lb.observe(model, digits.images[:4], digits.labels[:4])
    with pytest.raises(UnsupportedThreatModel, match="LOKI block"):
        lb.attack("loki", obs)


def test_bad_options_are_refused(digits):
    from leakbench.errors import ConfigError

    with pytest.raises(ConfigError, match="threshold"):
        lb.attacks.create("loki", threshold=2.0)
    with pytest.raises(ConfigError, match="consistency"):
        lb.attacks.create("loki", consistency=0.0)
