"""LPIPS from user-supplied weights (the lpips package layout), loaded with weights_only, and its refusals."""
from __future__ import annotations

import sys

import pytest
import torch

from leakbench.errors import ConfigError
from leakbench.metrics import compare, lpips_available, lpips_distance
from leakbench.metrics import perceptual

# a stand-in for the lpips package's network code: a backbone of slices holding torchvision's features by index,
# and linear heads lin0…; the distance is |lin0(net(a)) − lin0(net(b))| averaged
FAKE = """
import torch
from torch import nn
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.slice1 = nn.Sequential()
        self.slice1.add_module("0", nn.Conv2d(3, 2, 3))
class LPIPS(nn.Module):
    built = []
    def __init__(self, net='alex', pretrained=True, pnet_rand=False, verbose=True):
        super().__init__()
        LPIPS.built.append((pretrained, pnet_rand))
        self.net = _Net()
        self.lin0 = nn.Sequential(nn.Dropout(), nn.Conv2d(2, 1, 1, bias=False))
    def forward(self, a, b, normalize=False):
        fa, fb = self.lin0(self.net.slice1(a)), self.lin0(self.net.slice1(b))
        return (fa - fb).abs().mean(dim=(1, 2, 3), keepdim=True)
"""


@pytest.fixture
def user_lpips(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "lpips").mkdir(parents=True)
    (site / "lpips" / "__init__.py").write_text(FAKE)
    (site / "torchvision").mkdir()
    (site / "torchvision" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # an empty hub cache
    root = tmp_path / "mine"
    (root / "weights" / "v0.1").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    heads = {"lin0.1.weight": torch.rand((1, 2, 1, 1), generator=g)}
    backbone = {"features.0.weight": torch.randn((2, 3, 3, 3), generator=g), "features.0.bias": torch.zeros(2),
                "classifier.1.weight": torch.zeros(1)}
    torch.save(heads, root / "weights" / "v0.1" / "alex.pth")
    torch.save(backbone, root / "alexnet-owt-7be5be79.pth")
    perceptual._model.cache_clear()
    yield root, heads, backbone
    perceptual._model.cache_clear()
    sys.modules.pop("lpips", None)


def test_user_weights_are_loaded_and_scored(user_lpips, monkeypatch):
    root, heads, backbone = user_lpips
    assert lpips_available(weights=root) == (True, "")
    x = torch.rand((2, 1, 32, 32), generator=torch.Generator().manual_seed(1))
    assert lpips_distance(x, x, weights=root).tolist() == [0.0, 0.0]
    model = perceptual._model("alex", str(root.resolve()))
    assert torch.equal(model.lin0[1].weight, heads["lin0.1.weight"])
    assert torch.equal(model.net.slice1[0].weight, backbone["features.0.weight"])
    import lpips

    assert lpips.LPIPS.built[-1] == (False, True)  # built bare: nothing downloaded, the user's tensors loaded
    monkeypatch.setenv(perceptual.LPIPS_WEIGHTS_ENV, str(root))  # the environment variable, as a sweep reads it
    s = compare(x.flip(0) * 0.5, x, lpips=True, chance_level=0.5)
    assert s["lpips"] > 0 and s["chance_lpips"] > 0 and "lpips_missing" not in s


def test_user_weights_refusals(user_lpips, tmp_path):
    root, heads, _ = user_lpips
    ok, reason = lpips_available(weights=tmp_path / "nowhere")
    assert not ok and "does not exist" in reason and "\n" not in reason
    torch.save({"lin9.weight": torch.zeros(1)}, root / "weights" / "v0.1" / "alex.pth")
    with pytest.raises(ConfigError, match="linear heads"):
        lpips_distance(torch.rand(1, 3, 32, 32), torch.rand(1, 3, 32, 32), weights=root)
    (root / "weights" / "v0.1" / "alex.pth").write_bytes(b"not a checkpoint")
    perceptual._model.cache_clear()
    with pytest.raises(ConfigError, match="weights_only=True"):
        lpips_distance(torch.rand(1, 3, 32, 32), torch.rand(1, 3, 32, 32), weights=root)
    (root / "alexnet-owt-7be5be79.pth").unlink()
    ok, reason = lpips_available(weights=root)
    assert not ok and "backbone" in reason


def test_user_weights_without_the_lpips_package_say_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(perceptual, "_module_dir", lambda name: None)
    ok, reason = lpips_available(weights=tmp_path)
    assert not ok and "'lpips'" in reason and "\n" not in reason
    s = compare(torch.rand(2, 3, 32, 32), torch.rand(2, 3, 32, 32), lpips=True, lpips_weights=tmp_path)
    assert s["lpips"] is None and s["lpips_missing"] == reason
