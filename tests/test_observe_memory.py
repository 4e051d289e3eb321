"""Issue 48: ``observe`` on a model whose copies do not fit in the memory left is one line, before any copy."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import leakbench as lb
import leakbench.threat as threat
from leakbench.errors import ConfigError


def test_a_model_over_the_memory_left_is_refused_before_any_copy(monkeypatch):
    model = lb.build("mlp:64", input_shape=(1, 8, 8), classes=10, seed=0)
    x, y = lb.load("digits").batch(2, seed=0)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(threat, "memory_available", lambda: (2.0 * size, "the process's memory limit (RLIMIT_AS)"))
    copies = []
    monkeypatch.setattr(threat.copy, "deepcopy", lambda *a, **k: copies.append(1))
    with pytest.raises(ConfigError, match="expected the observation to fit in memory.*RLIMIT_AS") as err:
        lb.observe(model, x, y)
    assert "\n" not in str(err.value) and not copies


def test_an_allocation_failure_inside_is_one_line(monkeypatch):
    model = lb.build("mlp:8", input_shape=(1, 8, 8), classes=10, seed=0)
    x, y = lb.load("digits").batch(2, seed=0)

    def refuse(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(threat, "_observe", refuse)
    with pytest.raises(ConfigError, match="out of memory while observing"):
        lb.observe(model, x, y)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_a_large_parameter_under_ulimit_v_is_one_line(tmp_path):
    script = textwrap.dedent("""
        import resource, torch, leakbench as lb
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 2_000_000))  # 0.5 GiB of weights
        x, y = lb.load("digits").batch(2, seed=0)
        vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + 1024**3, resource.RLIM_INFINITY))  # 1 GiB more
        try:
            lb.observe(model, x, y)
        except lb.errors.ConfigError as err:
            print("REFUSED", err)
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith("REFUSED expected the observation to fit in memory"), done.stdout
    assert "RLIMIT_AS" in done.stdout and torch is not None
