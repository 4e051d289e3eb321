"""FedAvg's client: E epochs of minibatch SGD (the ``local:k,lr,b[,shuffle]`` defense, ``observe(local_batch=)``).

The simulated round must equal an explicit ``torch.optim.SGD`` loop over the same minibatches, the
matching engine must simulate the same update for the true batch, and fc-inversion must read a batch-1
sample exactly from an update after two epochs.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import leakbench as lb
from leakbench.attacks.solvers.gradient_matching import GradientMatcher
from leakbench.attacks.solvers.matching_settings import MatchingSettings
from leakbench.defenses import parse
from leakbench.defenses.pipeline import minibatches, share
from leakbench.errors import ConfigError
from leakbench.threat import Observation

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    data = lb.load("digits", size=8)
    model = lb.build("mlp:24", input_shape=data.shape, classes=10, act="sigmoid", seed=1)
    x, y = data.batch(6, seed=3)
    return model, x, y


def _sgd_loop(model, x, y, batches, lr):
    """The client as a user writes it: torch.optim.SGD over the given minibatches."""
    client = copy.deepcopy(model)
    opt = torch.optim.SGD(client.parameters(), lr=lr)
    for idx in batches:
        opt.zero_grad()
        F.cross_entropy(client(x[idx]), y[idx]).backward()
        opt.step()
    return [a.detach() - b.detach() for a, b in zip(client.parameters(), model.parameters())]


def test_minibatches_cover_every_sample_each_epoch():
    gen = torch.Generator().manual_seed(0)
    steps = minibatches(7, 3, 3, shuffle=True, generator=gen)
    assert [len(s) for s in steps] == [3, 3, 1] * 3
    for e in range(3):
        assert sorted(torch.cat(steps[3 * e:3 * e + 3]).tolist()) == list(range(7))
    assert [s.tolist() for s in minibatches(4, 2, None)] == [[0, 1, 2, 3]] * 2
    with pytest.raises(ConfigError, match="minibatch size"):
        minibatches(4, 1, 0)


@pytest.mark.parametrize("shuffle", [False, True])
def test_round_equals_explicit_sgd_loop(setup, shuffle):
    model, x, y = setup
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(5)
    got = share(f"local:2,0.3,4,{str(shuffle).lower()}", model, params, x, y, F.cross_entropy, generator=gen)
    assert got.kind == "update" and got.local_steps == 4 and got.shuffled == shuffle
    assert [len(b) for b in got.batches] == [4, 2, 4, 2]
    if not shuffle:
        assert got.batches == [[0, 1, 2, 3], [4, 5], [0, 1, 2, 3], [4, 5]]
    else:  # a fresh permutation per epoch, each covering the batch
        assert sorted(got.batches[0] + got.batches[1]) == list(range(6))
        assert got.batches[:2] != got.batches[2:] or got.batches[0] != [0, 1, 2, 3]
    reference = _sgd_loop(model, x, y, got.batches, 0.3)
    for a, b in zip(got.tensors, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # a full-batch pass differs: the minibatches matter
    full = share("local:2,0.3", model, params, x, y, F.cross_entropy, generator=gen)
    assert max(float((a - b).abs().max()) for a, b in zip(full.tensors, got.tensors)) > 1e-3


def test_observe_and_from_update_agree_and_the_engine_simulates_the_round(setup):
    model, x, y = setup
    obs = lb.observe(model, x, y, local_steps=2, local_lr=0.3, local_batch=4, labels_known=True)
    same = lb.observe(model, x, y, defense="local:2,0.3,4", labels_known=True)
    assert obs.local_batches == same.local_batches == [[0, 1, 2, 3], [4, 5], [0, 1, 2, 3], [4, 5]]
    assert obs.extras["local_order"] == "known"
    client_update = _sgd_loop(model, x, y, obs.local_batches, 0.3)
    after = copy.deepcopy(model)
    with torch.no_grad():
        for p, d in zip(after.parameters(), client_update):
            p.add_(d)
    captured = Observation.from_update(model, after, batch_size=6, lr=0.3, epochs=2, minibatch=4, labels=y)
    assert captured.local_steps == 4 and captured.local_batches == obs.local_batches
    for a, b in zip(captured.shared, obs.shared):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # the matching engine, given the true batch, simulates the very update the client sent
    matcher = GradientMatcher(obs, MatchingSettings(iterations=1))
    simulated = matcher.shared_of(x.to(obs.dtype), y)
    for a, b in zip(simulated, obs.shared):
        torch.testing.assert_close(a.detach(), b, rtol=1e-4, atol=1e-7)
    # while the old full-batch assumption does not
    full = GradientMatcher(Observation(**{**obs.__dict__, "local_batches": None}), MatchingSettings(iterations=1))
    off = full.shared_of(x.to(obs.dtype), y)
    assert max(float((a.detach() - b).abs().max()) for a, b in zip(off, obs.shared)) > 1e-3


def test_shuffled_order_stays_with_the_client(setup):
    model, x, y = setup
    obs = lb.observe(model, x, y, defense="local:2,0.3,4,true", seed=2)
    assert obs.local_batches == [[0, 1, 2, 3], [4, 5], [0, 1, 2, 3], [4, 5]]
    assert obs.extras["local_order"].startswith("shuffled")
    # a user who captured their own round can give the order
    perms = [torch.randperm(6, generator=torch.Generator().manual_seed(e)) for e in range(2)]
    after = copy.deepcopy(model)
    Observation.from_update(model, after, batch_size=6, lr=0.3, epochs=2, minibatch=4, order=perms)
    with pytest.raises(ConfigError, match="permutation"):
        Observation.from_update(model, after, batch_size=6, lr=0.3, epochs=2, minibatch=4, order=[[0, 1], [1, 0]])


def test_fc_inversion_reads_a_sample_from_two_epochs_of_minibatch_sgd():
    """Batch 1 after two local epochs: ΔW₁[k]/Δb₁[k] = x exactly (the first layer's input never changes)."""
    data = lb.load("digits", size=8)
    model = lb.build("mlp:32", input_shape=data.shape, classes=10, act="relu", seed=0)
    x, y = data.batch(1, seed=11)
    obs = lb.observe(model, x, y, defense="local:2,0.1,1")
    assert obs.kind == "update" and obs.local_steps == 2
    rec = lb.attack("fc-inversion", obs)
    exact = lb.compare(rec, x, y)
    grey = lb.compare(lb.Reconstruction(images=torch.full_like(x, 0.5), labels=y), x, y)  # chance control
    assert exact["mse"] < 1e-10 and exact["psnr"] > 80
    assert grey["psnr"] < 15


def test_bad_local_batch_is_refused(setup):
    model, x, y = setup
    with pytest.raises(ConfigError, match="local_batch"):
        lb.observe(model, x, y, local_batch=2)
    with pytest.raises(ConfigError, match="minibatch size b"):
        parse("local:2,0.1,-1")
    assert parse("local:2,0.1,4,true").spec == "local:2,0.1,4,true"
