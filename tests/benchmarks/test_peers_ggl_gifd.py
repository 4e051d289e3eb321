"""The GGL and GIFD peer benchmarks' harnesses: they skip without the peers' environments; GGL's script is imported
with an empty command line; GIFD's layer-wise generator interface composes the library's stages exactly, hands back
features it may optimise in place, and its radii are the relative radius times each feature's mean ℓ1 norm."""
from __future__ import annotations

import sys
import warnings

import pytest
import torch

from benchmarks import bench_peers_gifd, bench_peers_ggl
from benchmarks.bench_peers_gifd import RADIUS_CODES, export_stages
from benchmarks.peers.gifd_reference import StagedBigGAN, config
from benchmarks.peers.ggl_reference import SCRIPT, load_script
from leakbench.models.prior import ConvDecoder, generator_stages


@pytest.mark.parametrize("module, variable, name", [(bench_peers_ggl, "LEAKBENCH_GGL_PYTHON", "peers_ggl"),
                                                    (bench_peers_gifd, "LEAKBENCH_GIFD_PYTHON", "peers_gifd")])
def test_skips_with_the_reason(module, variable, name, monkeypatch, capsys):
    monkeypatch.delenv(variable, raising=False)
    module.run(quick=True)
    out = capsys.readouterr().out
    assert f"{name} skipped" in out and variable in out


def test_ggl_script_is_imported_with_an_empty_command_line(tmp_path, monkeypatch):
    (tmp_path / SCRIPT).write_text("import argparse, sys\np = argparse.ArgumentParser()\n"
                                   "p.add_argument('--budget', type=int, default=500)\nargs = p.parse_args()\n"
                                   "seen = list(sys.argv)\n")
    monkeypatch.setattr(sys, "argv", ["bench", "--not-theirs", "7"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    module = load_script(str(tmp_path))
    assert module.args.budget == 500 and module.seen == [SCRIPT]
    assert sys.argv == ["bench", "--not-theirs", "7"] and sys.path[0] == str(tmp_path)


def _traced(tmp_path, latent=3):
    decoder = ConvDecoder(latent, (3, 8, 8), width=2).eval()
    paths, radii = export_stages(decoder, latent, 0.3, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        stages = [torch.jit.load(p) for p in paths]
    return decoder, stages, radii


def test_staged_interface_composes_the_decoder_from_any_layer(tmp_path):
    decoder, stages, _ = _traced(tmp_path)
    gen = StagedBigGAN(stages, 3)
    ys = torch.zeros(2, 1000)
    z = torch.randn(2, 128)                        # the reference draws BigGAN's 128-entry codes
    image, back = gen(z, ys, 1)
    assert back is ys
    assert torch.allclose(image, 2 * decoder(z[:, :3]) - 1, atol=1e-6)
    fs = generator_stages(decoder)
    h = z[:, :3]
    for k in range(1, len(fs)):                    # from the output of stage k, as the reference's round k
        h = fs[k - 1](h)
        gen.start_layer, gen.end_layer = k, len(fs)
        assert torch.allclose(gen(h, ys, 1)[0], 2 * decoder(z[:, :3]) - 1, atol=1e-6)
        if k + 1 < len(fs):                        # the next round's start: stage k's output, not a view
            gen.end_layer = k + 1
            feature = gen(h, ys, 1)[0]
            assert torch.allclose(feature, fs[k](h), atol=1e-6) and feature._base is None


def test_radii_are_the_relative_radius_times_each_features_mean_l1_norm(tmp_path):
    decoder, _, radii = _traced(tmp_path)
    h = torch.randn(RADIUS_CODES, 3, generator=torch.Generator().manual_seed(0))
    fs = generator_stages(decoder)
    expected = []
    with torch.no_grad():
        for stage in fs[:-1]:
            h = stage(h)
            expected.append(0.3 * float(h.reshape(len(h), -1).abs().sum(1).mean()))
    assert radii == pytest.approx(expected, rel=1e-6)
    options = config(10, 5, 2, radii)              # one latent round, one round per feature space
    assert options["steps"] == [10, 5, 5, 5] and options["end_layer"] == len(fs)
    assert options["max_radius_gen_out"] == [-1.0, *radii] and len(options["lr_io"]) == len(fs)


def test_runner_command_line_sets_threads_seeds_and_the_checkout_first(tmp_path, monkeypatch):
    from benchmarks.peers._cli import parse

    monkeypatch.setattr(sys, "argv", ["runner", "--repo", str(tmp_path), "--model", "m.pt", "--out", "o.npz",
                                      "--latent-steps", "7", "--seed", "3"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    threads = torch.get_num_threads()
    try:
        args = parse("a runner", ("model",), latent_steps=200, rounds=40)
        first = torch.rand(2)
        torch.manual_seed(3)
        assert torch.equal(first, torch.rand(2))
        assert (args.model, args.latent_steps, args.rounds, args.threads) == ("m.pt", 7, 40, 1)
        assert torch.get_num_threads() == 1 and sys.path[0] == str(tmp_path)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(sys, "argv", ["runner", "--repo", str(tmp_path), "--out", "o.npz"])
    with pytest.raises(SystemExit):                 # a required input file missing
        parse("a runner", ("model",))
