"""The peer benchmark's pieces that run without a breaching environment: the held-out batches, the matched
PSNR both sides are scored by, and the skip with its reason."""
from __future__ import annotations

import sys

import numpy as np
import torch

import leakbench as lb
from benchmarks.bench_peers import ENV, HELD_OUT, PER_CLASS, breaching_python, held_out, run
from benchmarks.common import psnr


def test_held_out_batches_are_held_out_and_mix_classes():
    for batch in (1, 4, 5, 8):
        indices = held_out(batch)
        assert len(set(indices)) == batch and min(indices) >= HELD_OUT
        classes = [i // PER_CLASS for i in indices]
        assert len(set(classes)) == min(batch, 5)  # one image per class before any class repeats


def test_batch_psnr_does_not_depend_on_the_order_of_the_slots():
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    noisy = (x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    shuffled = noisy[torch.tensor([2, 0, 3, 1])]
    assert abs(psnr(shuffled, x) - psnr(noisy, x)) < 1e-9
    # and it is the per-sample PSNR, averaged
    assert abs(psnr(noisy, x) - float(lb.metrics.psnr(noisy, x).mean())) < 1e-9
    assert psnr(shuffled, x) > psnr(torch.full_like(x, 0.5), x) + 10  # far above the grey chance level


def test_skips_with_the_reason(monkeypatch, capsys):
    monkeypatch.delenv(ENV, raising=False)
    assert breaching_python() == (None, f"{ENV} is not set (the Python of a venv where `import breaching` works)")
    monkeypatch.setenv(ENV, sys.executable)  # this Python has no breaching
    python, why = breaching_python()
    assert python is None and "cannot import breaching" in why
    run(quick=True)
    assert "peers: skipped" in capsys.readouterr().out


def test_settings_choose_sizes_and_disjoint_held_out_batches():
    from benchmarks.bench_peers import settings_from

    default = settings_from("", "")
    assert [b for b, _ in default] == [1, 1, 1, 4, 8] and default[-1][1] == held_out(8)
    eights = settings_from("8", "0,1,2")
    assert [b for b, _ in eights] == [8, 8, 8]
    seen = [i for _, indices in eights for i in indices]
    assert len(seen) == len(set(seen)) == 24 and min(seen) >= HELD_OUT  # three disjoint held-out batches
    for bad in (("x", ""), ("0", ""), ("8", "-1"), ("8", "60")):
        try:
            settings_from(*bad)
        except SystemExit as err:
            assert "LEAKBENCH_PEERS" in str(err)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_layout_batches_are_disjoint_held_out_and_have_their_label_layout():
    from benchmarks.bench_peers import LAYOUTS, layout_batch

    for batch in (2, 4, 8, 16, 20):
        everything = []
        for layout in LAYOUTS:
            batches = [layout_batch(layout, batch, k) for k in range(3)]
            seen = [i for b in batches for i in b]
            # three disjoint batches of the layout (the 2 × B/2 batches once shared half their images)
            assert len(seen) == len(set(seen)) == 3 * batch, (layout, batch)
            assert min(seen) >= HELD_OUT
            for b in batches:
                counts = sorted(np.unique([i // PER_CLASS for i in b], return_counts=True)[1].tolist())
                want = {"mixed": None, "2x": [batch // 2] * 2, "1x": [batch]}[layout]
                assert want is None or counts == want, (layout, batch, counts)
            everything += seen
        assert len(everything) == len(set(everything))  # and no image in two layouts
