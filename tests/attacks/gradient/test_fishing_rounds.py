"""Multi-round feature fishing (Wen et al. 2022, Sec. 3.2): the server re-queries the client at thresholds it
chooses and reads single samples, of any class, from differences of two rounds."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError, NothingRecovered, UnsupportedThreatModel
from leakbench.models.active import fishing, refished


@pytest.fixture(scope="module")
def digits():
    return lb.load("digits")


def _fished(digits, spec: str, target: int = 3, batch=range(1300, 1332)):
    model = lb.build(spec, input_shape=digits.shape, classes=10, seed=0)
    shipped = fishing(model, target=target, quantile=0.5, calibration=digits.subset(list(range(1000, 1300))))
    x, y = digits.batch(indices=list(batch))
    obs = lb.observe(shipped, x, y, seed=0)
    obs.extras["query"] = lb.requery(x, y, seed=0)
    return obs, x


def _errors(rec, x):
    b = x.shape[0]
    r = rec.images.reshape(b, -1).double()
    return (r[:, None] - x.reshape(b, -1).double()[None]).abs().amax(-1).min(1).values   # per slot: nearest original


@pytest.mark.parametrize("spec", ["mlp:200", "mlp:300-100"])
def test_isolated_samples_are_read_exactly_and_grey_is_not(digits, spec):
    obs, x = _fished(digits, spec)
    rec = lb.attack("fishing-rounds", obs)
    err = _errors(rec, x)
    claimed = rec.confidence > 0
    isolated = rec.trace["isolated"]
    assert isolated >= 28 and int(claimed.sum()) == isolated <= rec.trace["rounds_used"] <= 96
    assert bool((err[claimed] < 1e-4).all())                     # every claimed slot is one sample, exactly
    assert len({int(torch.cdist(rec.images[i].reshape(1, -1), x.reshape(32, -1)).argmin()) for i in
                claimed.nonzero().flatten().tolist()}) == isolated   # distinct samples
    grey = torch.full_like(x[:1], 0.5).reshape(1, -1).double()
    assert float((grey - x.reshape(32, -1).double()).abs().amax(1).min()) > 0.3   # chance: nowhere near exact


def test_one_round_is_not_enough_and_the_budget_is_kept(digits):
    obs, x = _fished(digits, "mlp:200")
    rec = lb.attack("fishing-rounds", obs, rounds=6)
    assert rec.trace["rounds_used"] <= 6 and rec.trace["isolated"] < 6
    with pytest.raises(ConfigError, match="rounds"):
        lb.attack("fishing-rounds", obs, rounds=1000)


def test_refished_moves_the_threshold_only(digits):
    obs, _ = _fished(digits, "mlp:64")
    moved = refished(obs.model, 0.25, 123.0)
    head = dict(moved.named_modules())[moved.fishing_head]
    w, b = head.weight.detach(), head.bias.detach()
    j, t = moved.fishing_feature, moved.fishing_target
    assert float(w[t, j]) == 123.0 and moved.fishing_threshold == 0.25
    assert float(b[t]) == pytest.approx(-123.0 * 0.25 + torch.log(torch.tensor(9.0)).item())
    assert obs.model.fishing_threshold != 0.25   # a copy
    with pytest.raises(ConfigError, match="feature-fishing"):
        refished(fishing(lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0), target=1), 0.0)


def test_it_says_what_it_needs(digits):
    x, y = digits.batch(4, seed=0)
    model = lb.build("mlp:32", input_shape=digits.shape, classes=10, seed=0)
    plain = lb.observe(fishing(model, target=1), x, y)
    plain.extras["query"] = lb.requery(x, y)
    with pytest.raises(UnsupportedThreatModel, match="quantile"):
        lb.attack("fishing-rounds", plain)
    obs, _ = _fished(digits, "mlp:32", batch=range(1300, 1304))
    obs.extras.pop("query")
    with pytest.raises(UnsupportedThreatModel, match="requery"):
        lb.attack("fishing-rounds", obs)
    shipped = obs.model
    aggregated = lb.observe(shipped, x, y, defense="secagg:2", population=digits)
    aggregated.extras["query"] = lb.requery(x, y, defense="secagg:2", population=digits)
    with pytest.raises(UnsupportedThreatModel, match="secure aggregation"):
        lb.attack("fishing-rounds", aggregated)
    update = lb.observe(shipped, x, y, defense="local:1,0.1")
    update.extras["query"] = lb.requery(x, y, defense="local:1,0.1")
    with pytest.raises(UnsupportedThreatModel, match="FedSGD gradients"):
        lb.attack("fishing-rounds", update)


def test_the_matching_read_out_inverts_each_difference_on_a_convnet(digits):
    obs, x = _fished(digits, "cnn:3-6-1-0,4-3-2-0", batch=range(1300, 1308))
    rec = lb.attack("fishing-rounds", obs, preset="quick", iterations=5, rounds=16)
    assert rec.trace["readout"] == "matching" and rec.trace["isolated"] >= 1
    assert int((rec.confidence > 0).sum()) == rec.trace["isolated"] and torch.isfinite(rec.images).all()


def test_under_noise_no_count_is_an_integer_and_it_says_so(digits):
    model = lb.build("mlp:200", input_shape=digits.shape, classes=10, seed=0)
    shipped = fishing(model, target=3, quantile=0.5, calibration=digits.subset(list(range(1000, 1300))))
    x, y = digits.batch(indices=list(range(1300, 1316)))
    obs = lb.observe(shipped, x, y, defense="noise:0.01", seed=0)
    obs.extras["query"] = lb.requery(x, y, defense="noise:0.01", seed=0)
    with pytest.raises(NothingRecovered, match="integral counts|isolated no sample"):
        lb.attack("fishing-rounds", obs, rounds=12)


def test_a_client_that_answers_garbage_is_named(digits):
    obs, _ = _fished(digits, "mlp:64", batch=range(1300, 1308))
    obs.extras["query"] = lambda model: {"not": "an observation"}
    with pytest.raises(ConfigError, match="extras\\['query'\\]"):
        lb.attack("fishing-rounds", obs, rounds=8)
