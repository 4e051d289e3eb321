"""The deep-image-prior U-Net generator."""
from __future__ import annotations

import pytest
import torch

from leakbench.errors import ConfigError
from leakbench.models.generator import UNetGenerator


@pytest.mark.parametrize("shape,depth", [((3, 32, 32), 3), ((1, 16, 16), 2), ((3, 15, 13), 3)])
def test_shapes_and_range(shape, depth):
    gen = UNetGenerator(shape, width=8, depth=depth, noise_channels=4, seed=0)
    z = gen.noise(2, seed=0)
    out = gen(z)
    assert out.shape == (2, *shape)
    assert float(out.min()) > 0 and float(out.max()) < 1


def test_seeded_and_global_rng_untouched():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = UNetGenerator((3, 16, 16), width=8, depth=2, seed=5)
    assert torch.equal(state, torch.get_rng_state())
    b = UNetGenerator((3, 16, 16), width=8, depth=2, seed=5)
    c = UNetGenerator((3, 16, 16), width=8, depth=2, seed=6)
    z = a.noise(1, seed=0)
    assert torch.equal(a(z), b(z)) and not torch.equal(a(z), c(z))


def test_samples_are_generated_independently():
    gen = UNetGenerator((3, 16, 16), width=8, depth=2, seed=0)
    z = gen.noise(3, seed=1)
    assert torch.allclose(gen(z)[1:2], gen(z[1:2]), atol=1e-6)


def test_can_fit_an_image():
    """The prior is trainable: a few hundred Adam steps fit one smooth image closely."""
    torch.manual_seed(0)
    gen = UNetGenerator((1, 16, 16), width=8, depth=2, noise_channels=4, seed=0)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, 16), torch.linspace(0, 1, 16), indexing="ij")
    target = (0.5 + 0.4 * torch.sin(6 * xx) * torch.cos(4 * yy))[None, None]
    z = gen.noise(1, seed=0)
    opt = torch.optim.Adam(gen.parameters(), lr=1e-2)
    first = float((gen(z) - target).pow(2).mean())
    for _ in range(150):
        opt.zero_grad()
        loss = (gen(z) - target).pow(2).mean()
        loss.backward()
        opt.step()
    assert float(loss) < first / 20


def test_bad_input():
    with pytest.raises(ConfigError, match="out_shape"):
        UNetGenerator((16, 16))
    with pytest.raises(ConfigError, match="depth"):
        UNetGenerator((3, 4, 4), depth=5)
    with pytest.raises(ConfigError, match="width"):
        UNetGenerator((3, 8, 8), width=0)
