"""The one matrix builder: conv/linear layers as matrices on the flattened input, and model chains."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leakbench as lb
from leakbench.errors import ConfigError, UnsupportedThreatModel
from leakbench.models.matrices import (bias_vector, conv_geometry, conv_system, gradient_matrix, layer_chain,
                                       weight_matrix)


def _random_convs(count: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    cases = []
    while len(cases) < count:
        c, o, k, s, p, d = draw(1, 4), draw(1, 5), draw(1, 5), draw(1, 3), draw(0, 3), draw(1, 2)
        h, w = draw(4, 13), draw(4, 13)
        if (h + 2 * p - d * (k - 1) - 1) < 0 or (w + 2 * p - d * (k - 1) - 1) < 0:
            continue
        cases.append((c, h, w, o, k, s, p, d))
    return cases


CASES = _random_convs(40)


def test_random_cases_cover_uneven_strides_padding_and_dilation():
    uneven = [cs for cs in CASES if (cs[1] + 2 * cs[6] - cs[7] * (cs[4] - 1) - 1) % cs[5] != 0]
    assert len(uneven) >= 5
    assert any(cs[6] > 0 for cs in CASES) and any(cs[5] > 1 for cs in CASES) and any(cs[7] > 1 for cs in CASES)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sparse", [False, True])
def test_weight_matrix_equals_conv2d(case, sparse):
    c, h, w, o, k, s, p, d = case
    torch.manual_seed(hash(case) % 1000)
    conv = nn.Conv2d(c, o, k, stride=s, padding=p, dilation=d).double()
    x = torch.randn(1, c, h, w, dtype=torch.float64)
    mat = weight_matrix(conv, (c, h, w), sparse=sparse)
    expected = F.conv2d(x, conv.weight, conv.bias, s, p, d).reshape(-1)
    got = mat @ x.reshape(-1) + bias_vector(conv, (c, h, w))
    assert mat.is_sparse == sparse
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES[:20])
def test_gradient_matrix_equals_autograd(case):
    c, h, w, o, k, s, p, d = case
    conv = nn.Conv2d(c, o, k, stride=s, padding=p, dilation=d, bias=False).double()
    x = torch.randn(1, c, h, w, dtype=torch.float64)
    z = conv(x)
    delta = torch.randn_like(z)
    (grad_w,) = torch.autograd.grad((z * delta).sum(), conv.weight)
    kmat = gradient_matrix(conv, (c, h, w), delta)
    torch.testing.assert_close(kmat @ x.reshape(-1), grad_w.reshape(-1), rtol=1e-12, atol=1e-12)
    ksparse = gradient_matrix(conv, (c, h, w), delta, sparse=True)
    torch.testing.assert_close(ksparse.to_dense(), kmat)


@pytest.mark.parametrize("case", CASES[::4])
def test_conv_system_equals_the_torch_builders(case):
    """The scipy CSR pair R-GAP solves with is exactly the dense weight and gradient matrices."""
    c, h, w, o, k, s, p, d = case
    conv = nn.Conv2d(c, o, k, stride=s, padding=p, dilation=d, bias=False).double()
    delta = torch.randn_like(conv(torch.zeros(1, c, h, w, dtype=torch.float64)))
    wmat, kmat = conv_system(conv, (c, h, w), delta)
    assert torch.equal(torch.from_numpy(wmat.toarray()), weight_matrix(conv, (c, h, w)))
    assert torch.equal(torch.from_numpy(kmat.toarray()), gradient_matrix(conv, (c, h, w), delta))
    with pytest.raises(ConfigError, match="upstream gradient"):
        conv_system(conv, (c, h, w), delta.reshape(-1)[:-1])


def test_same_padding_and_linear_layers():
    conv = nn.Conv2d(2, 3, 4, padding="same").double()
    x = torch.randn(1, 2, 7, 6, dtype=torch.float64)
    torch.testing.assert_close(weight_matrix(conv, (2, 7, 6)) @ x.reshape(-1) + bias_vector(conv, (2, 7, 6)),
                               conv(x).reshape(-1))
    lin = nn.Linear(5, 3).double()
    v = torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(weight_matrix(lin, (5,)) @ v + bias_vector(lin, (5,)), lin(v))
    delta = torch.randn(3, dtype=torch.float64)
    (gw,) = torch.autograd.grad((lin(v) * delta).sum(), lin.weight)
    torch.testing.assert_close(gradient_matrix(lin, (5,), delta) @ v, gw.reshape(-1))


def test_bad_inputs_name_the_problem():
    conv = nn.Conv2d(3, 4, 3)
    with pytest.raises(ConfigError, match="input_shape"):
        weight_matrix(conv, (2, 8, 8))
    with pytest.raises(ConfigError, match="too small"):
        conv_geometry(conv, (3, 2, 2))
    with pytest.raises(UnsupportedThreatModel, match="grouped"):
        weight_matrix(nn.Conv2d(4, 4, 3, groups=2), (4, 8, 8))
    with pytest.raises(ConfigError, match="upstream"):
        gradient_matrix(conv, (3, 8, 8), torch.zeros(5))


def test_chain_of_a_spec_model_lists_blocks_with_shapes():
    model = lb.build("cnn:3-6-1-0,4-3-2-0", input_shape=(3, 32, 32), classes=10, act="tanh", seed=0)
    chain = layer_chain(model, (3, 32, 32))
    assert [b.kind for b in chain.blocks] == ["conv", "conv", "linear"]
    assert [b.act for b in chain.blocks] == ["tanh", "tanh", "identity"]
    assert chain.blocks[1].input_shape == (6, 30, 30) and chain.blocks[2].input_shape == (588,)
    x = torch.rand(2, 6, 30, 30)
    torch.testing.assert_close(chain.tail(1)(x), nn.Sequential(*list(model.children())[2:])(x))


def test_chain_accepts_plain_sequentials_and_rejects_non_chains():
    seq = nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.LeakyReLU(0.3), nn.Linear(5, 2))
    chain = layer_chain(seq, (3, 4))
    assert [b.act for b in chain.blocks] == ["leaky-relu", "identity"] and chain.blocks[0].slope == 0.3
    with pytest.raises(UnsupportedThreatModel, match="MaxPool2d"):
        layer_chain(lb.build("convnet-4", input_shape=(3, 32, 32), classes=10, seed=0, norm=False), (3, 32, 32))

    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.b(self.a(x) + x)

    with pytest.raises(UnsupportedThreatModel, match="one after the other"):
        layer_chain(Skip(), (4,))
