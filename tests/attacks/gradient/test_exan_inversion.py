"""Exclusivity (Pan et al. 2022): every sample flagged unique is rebuilt exactly; flags match a brute force."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.analysis import exclusivity as analyse
from leakbench.errors import UnsupportedThreatModel


def nearest_error(images: torch.Tensor, x: torch.Tensor) -> list[tuple[int, float]]:
    """For each reconstruction: (index of the nearest original, relative error to it)."""
    flat, ref = images.double().reshape(len(images), -1), x.double().reshape(len(x), -1)
    out = []
    for row in flat:
        dist = (ref - row).norm(dim=1) / ref.norm(dim=1)
        out.append((int(dist.argmin()), float(dist.min())))
    return out


CASES = [  # dataset, options, model, batch, dtype
    ("digits", {"size": 28}, "mlp:1000", 8, torch.float64),
    ("digits", {"size": 28}, "mlp:1000-1000", 16, torch.float64),
    ("digits", {"size": 28}, "mlp:2000-500", 12, torch.float32),
    ("photos", {"size": 32}, "mlp:2000", 4, torch.float32),
]


@pytest.mark.parametrize("name,opts,spec,batch,dtype", CASES)
def test_every_sample_flagged_unique_is_exact(name, opts, spec, batch, dtype):
    data = lb.load(name, **opts)
    x, y = data.batch(batch, seed=3)
    x = x.to(dtype)
    model = lb.build(spec, input_shape=data.shape, classes=data.num_classes, seed=1, dtype=dtype)
    rec = lb.attack("exclusivity", lb.observe(model, x, y))
    unique = rec.trace["unique"]
    assert sum(unique) >= batch // 2, rec.trace  # these batches are mostly in the exclusive regime
    matches = nearest_error(rec.images, x)
    hits = [m for m, u in zip(matches, unique) if u]
    assert all(err < 1e-5 for _, err in hits), hits
    assert len({i for i, _ in hits}) == len(hits)  # distinct samples
    for (i, _), u, label in zip(matches, unique, rec.labels.tolist()):
        if u:
            assert label == int(y[i])
    assert rec.confidence.tolist() == [float(u) for u in unique]


def test_analysis_reconstructable_samples_are_recovered():
    data = lb.load("digits", size=28)
    x, y = data.batch(12, seed=5)
    x = x.double()
    model = lb.build("mlp:1000-1000", input_shape=data.shape, classes=10, seed=2, dtype=torch.float64)
    report = analyse(model, x, y)
    rec = lb.attack("exclusivity", lb.observe(model, x, y))
    recovered = {i for (i, err), u in zip(nearest_error(rec.images, x), rec.trace["unique"]) if u and err < 1e-5}
    predicted = {m for m, ok in enumerate(report.reconstructable) if ok}
    assert predicted and predicted <= recovered


def _theorem2_setup(d0: int, d1: int, M: int, seed: int) -> tuple[nn.Sequential, torch.Tensor]:
    """A ReLU MLP d0-d1-600-5 and a batch in the regime of Theorem 2 (d1 < d0, d1 < M).

    First-layer pre-activations are placed so that neuron 0 fires for sample 0 only (an ExAN:
    sample 0 is pinned) and the others lie on a sphere (convex position, so the wide second
    layer, made to fire for one sample per neuron, gives every sample ExANs there).
    """
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    net = nn.Sequential(nn.Linear(d0, d1), nn.ReLU(), nn.Linear(d1, 600), nn.ReLU(), nn.Linear(600, 5)).double()
    with torch.no_grad():
        for layer in (net[0], net[2], net[4]):
            layer.weight.copy_(rand(*layer.weight.shape))
            layer.bias.copy_(0.1 * rand(*layer.bias.shape))
        sphere = rand(M, d1 - 1)
        z1 = torch.cat([-torch.ones(M, 1, dtype=torch.float64), 2 + sphere / sphere.norm(dim=1, keepdim=True)], 1)
        z1[0, 0] = 1.0
        w0 = net[0].weight
        null = torch.linalg.svd(w0, full_matrices=True).Vh[d1:].T
        x = (torch.linalg.pinv(w0) @ (z1 - net[0].bias).T).T + 0.3 * rand(M, d0 - d1) @ null.T
        pre = net[2](torch.relu(net[0](x)))
        top2 = pre.topk(2, dim=0).values
        net[2].bias.sub_(top2[0] - 0.3 * (top2[0] - top2[1]))  # each neuron fires for one sample only
    return net, x


def brute_force_free(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[bool]:
    """Samples moved by the null space of the Jacobian of the shared gradient w.r.t. the batch."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, batch):
        return nn.functional.cross_entropy(torch.func.functional_call(model, p, (batch,)), y)

    def shared(batch):
        grads = torch.func.grad(loss)(params, batch)
        return torch.cat([grads[n].reshape(-1) for n in params])

    jac = torch.func.jacfwd(shared)(x).reshape(-1, x.numel())  # forward mode: one pass per input entry
    _, s, vh = torch.linalg.svd(jac, full_matrices=False)  # more rows than columns: vh is square
    rank = int((s > 1e-9 * s.max()).sum())
    null = vh[rank:].reshape(-1, *x.shape)
    return [bool(null[:, m].norm() > 1e-6) for m in range(x.shape[0])]


@pytest.mark.parametrize("M", [3, 6, 8])
def test_unique_flags_agree_with_brute_force_theorem2_check(M):
    d0, d1 = 10, 4  # d1 < d0: Theorem 2 applies once M > d1
    model, x = _theorem2_setup(d0, d1, M, seed=M)
    y = torch.arange(M) % 5
    rec = lb.attack("exclusivity", lb.observe(model, x, y))
    assert rec.trace["identified"] == M
    free = brute_force_free(model, x, y)
    unique = rec.trace["unique"]
    matches = nearest_error(rec.images, x)
    assert all(err < 1e-8 for (_, err), u in zip(matches, unique) if u)
    pinned = sorted(i for (i, _), u in zip(matches, unique) if u)
    assert pinned == [m for m in range(M) if not free[m]]
    if M > d1:  # sample 0 has an ExAN in layer 1 and is pinned; the others move in the invariant space
        assert pinned == [0]
    else:
        assert pinned == list(range(M))


def test_requirements():
    data = lb.load("digits", size=8)
    x, y = data.batch(4, seed=0)
    tanh = lb.build("mlp:50", input_shape=data.shape, classes=10, act="tanh", seed=0)
    with pytest.raises(UnsupportedThreatModel, match="ReLU"):
        lb.attack("exclusivity", lb.observe(tanh, x, y))
    cnn = lb.build("cnn:3-4-1-0", input_shape=data.shape, classes=10, seed=0)
    with pytest.raises(UnsupportedThreatModel, match="MLP"):
        lb.attack("exclusivity", lb.observe(cnn, x, y))
    relu = lb.build("mlp:50", input_shape=data.shape, classes=10, seed=0)
    with pytest.raises(UnsupportedThreatModel, match="cross-entropy"):
        lb.attack("exclusivity", lb.observe(relu, x, y, loss="mse"))
    nobias = lb.build("mlp:50", input_shape=data.shape, classes=10, bias=False, seed=0)
    with pytest.raises(UnsupportedThreatModel, match="bias"):
        lb.attack("exclusivity", lb.observe(nobias, x, y))


def test_a_noised_gradient_determines_nothing_and_returns_no_image():
    """Under strong noise no group of ExAN rows agrees: the attack says so instead of returning a grey batch."""
    import leakbench as lb
    from leakbench.errors import NothingRecovered

    data = lb.load("digits", size=8)
    x, y = data.batch(4, seed=0)
    model = lb.build("mlp:64", input_shape=data.shape, classes=10, act="relu", seed=0).eval()
    obs = lb.observe(model, x, y, defense="noise:1", seed=0)
    with pytest.raises(NothingRecovered, match="determined nothing"):
        lb.attack("exclusivity", obs)
