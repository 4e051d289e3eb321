"""Images from known features: exact least squares where the rows determine the input, bounds that hold."""
from __future__ import annotations

import torch
from torch import nn

from leakbench.attacks.solvers.feature_inversion import feature_bounds, invert_features
from leakbench.models.matrices import layer_chain


def _chain(conv: nn.Conv2d, act: nn.Module, shape=(2, 6, 6), width=20):
    torch.manual_seed(0)
    out = conv(torch.zeros(1, *shape)).numel()
    model = nn.Sequential(conv, act, nn.Flatten(), nn.Linear(out, width), nn.ReLU(), nn.Linear(width, 3)).double()
    return model, layer_chain(model, shape)


def _features(model, chain, x):
    with torch.no_grad():
        return nn.Sequential(*chain.modules[:chain.blocks[1].start])(x).reshape(len(x), -1)


def test_full_rank_relu_and_leaky_layers_are_inverted_exactly():
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(5, 2, 6, 6, generator=gen, dtype=torch.float64)
    for act in (nn.ReLU(), nn.LeakyReLU(0.1), nn.Tanh()):
        model, chain = _chain(nn.Conv2d(2, 8, 3, padding=1), act)
        inv = invert_features(chain, 1, _features(model, chain, x), (0.0, 1.0))
        assert bool(inv.exact.all()), (act, inv.layers)
        torch.testing.assert_close(inv.images, x, atol=1e-8, rtol=0)


def test_rank_deficient_rows_are_not_called_exact_and_the_optimisation_lowers_the_misfit():
    # stride 2 and 2 output channels: 18 rows (fewer live) for 72 unknowns — the features do not fix the image
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(3, 2, 6, 6, generator=gen, dtype=torch.float64)
    model, chain = _chain(nn.Conv2d(2, 2, 3, stride=2, padding=1), nn.ReLU())
    z = _features(model, chain, x)
    none = invert_features(chain, 1, z, (0.0, 1.0), steps=0)
    some = invert_features(chain, 1, z, (0.0, 1.0), steps=300)
    assert not bool(none.exact.any()) and not bool(some.exact.any())
    assert none.layers[0]["rank_min"] < 72
    assert float(some.residual.mean()) <= float(none.residual.mean()) + 1e-12
    assert float(some.images.min()) >= 0 and float(some.images.max()) <= 1


def test_feature_bounds_hold_for_inputs_in_the_box():
    model, chain = _chain(nn.Conv2d(2, 8, 3, padding=1), nn.ReLU())
    lo, hi = feature_bounds(chain, 1, (0.0, 1.0))
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(200, 2, 6, 6, generator=gen, dtype=torch.float64)
    corners = torch.randint(0, 2, (200, 2, 6, 6), generator=gen).double()   # the box's corners reach the bounds
    z = _features(model, chain, torch.cat([x, corners]))
    assert lo == 0.0 and float(z.min()) >= lo and float(z.max()) <= hi
    assert float(z.max()) > 0.3 * hi                                          # and are not vacuous
