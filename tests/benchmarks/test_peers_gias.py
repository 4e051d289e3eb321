"""The GIAS peer benchmark's harness: it skips without the peer's environment, and its generator wrapper copies
into trainable, independent generators as the reference's per-image fine-tuning needs."""
from __future__ import annotations

import copy

import pytest
import torch

from benchmarks import bench_peers_gias
from benchmarks.peers.gias_reference import Wrapped, _cuda_to_cpu
from leakbench.models.prior import ConvDecoder


def test_skips_with_the_reason(monkeypatch, capsys):
    monkeypatch.delenv("LEAKBENCH_GIAS_PYTHON", raising=False)
    monkeypatch.setenv("LEAKBENCH_GIAS_REPO", "/no/such/checkout")
    bench_peers_gias.run(quick=True)
    out = capsys.readouterr().out
    assert "peers_gias skipped" in out and "LEAKBENCH_GIAS_PYTHON" in out


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning")
def test_wrapped_traced_decoder_maps_codes_and_copies_into_trainable_leaves(tmp_path):
    decoder = ConvDecoder(3, (1, 8, 8), width=2).eval()
    traced = torch.jit.trace(decoder, torch.zeros(2, 3))      # the export: any batch size after tracing
    gen = Wrapped(traced, 3)
    z = torch.randn(5, 100, 1, 1)
    assert torch.allclose(gen(z), 2 * decoder(z.flatten(1)[:, :3]) - 1, atol=1e-6)
    assert gen.G_synthesis is gen and "G_synthesis" not in dict(gen.named_children())
    copies = [copy.deepcopy(gen) for _ in range(2)]
    for c in copies:
        c.requires_grad_(True)
        assert all(p.is_leaf and p.requires_grad for p in c.parameters())
    before = copies[1](z).detach()
    opt = torch.optim.Adam(copies[0].parameters(), lr=1e-2)
    copies[0](z).pow(2).sum().backward()
    opt.step()
    assert not torch.allclose(copies[0](z), before) and torch.equal(copies[1](z).detach(), before)


def test_the_literal_cuda_device_maps_to_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.nn.Module, "to", torch.nn.Module.to)     # restored after the test
    monkeypatch.setattr(torch.Tensor, "to", torch.Tensor.to)
    _cuda_to_cpu()
    assert torch.ones(2).to("cuda:0").device.type == "cpu"
    assert torch.nn.Linear(2, 2).to(device="cuda:0").weight.device.type == "cpu"
    assert torch.ones(2).to(torch.float64).dtype == torch.float64
