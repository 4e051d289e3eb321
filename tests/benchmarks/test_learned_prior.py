"""The learned-prior benchmark's network choice: ``LEAKBENCH_PRIOR_MODEL`` names the attacked network by a model
spec, a bad spec stops with the variable's name, and the default stays the documented ``convnet-16``."""
from __future__ import annotations

import pytest

from benchmarks import bench_learned_prior


def test_a_bad_model_spec_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("LEAKBENCH_PRIOR_DATA", "digits")
    monkeypatch.setenv("LEAKBENCH_PRIOR_MODEL", "convnet-x")
    with pytest.raises(SystemExit, match="LEAKBENCH_PRIOR_MODEL: .*convnet-x"):
        bench_learned_prior.setting(tmp_path, 12, quick=True)


@pytest.mark.parametrize("spec, expected", [("", "convnet-16"), ("convnet-4", "convnet-4")])
def test_the_named_network_is_trained_and_reported(monkeypatch, tmp_path, spec, expected):
    monkeypatch.setenv("LEAKBENCH_PRIOR_DATA", "digits")
    monkeypatch.setenv("LEAKBENCH_PRIOR_MODEL", spec)
    s = bench_learned_prior.setting(tmp_path, 12, quick=True)
    assert s.name == expected
    assert s.model.conv0.out_channels == int(expected.split("-")[1])
    assert not s.model.training and 0.0 <= s.accuracy <= 1.0
