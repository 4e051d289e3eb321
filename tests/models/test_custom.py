"""Own classes by import path: construction, normalisation in front, weights files and model files."""
from __future__ import annotations

import textwrap

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError
from leakbench.models.custom import Normalize
from leakbench.models.files import load_model, load_weights, save_model

SRC = textwrap.dedent('''
    from torch import nn

    class Lin(nn.Module):
        def __init__(self, input_shape, classes, bias=True):
            super().__init__()
            self.fc = nn.Linear(input_shape[0] * input_shape[1] * input_shape[2], classes, bias=bias)

        def forward(self, x):
            return self.fc(x.flatten(1))
''')


@pytest.fixture
def spec(tmp_path, monkeypatch):
    name = f"ownlin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:Lin"


def test_build_seeds_fills_shape_and_normalises(spec):
    a = lb.build(spec, input_shape=(1, 4, 4), classes=3, seed=1, normalize=([0.5], [0.25]))
    b = lb.build(spec, input_shape=(1, 4, 4), classes=3, seed=1, normalize=([0.5], [0.25]))
    assert isinstance(a.normalize, Normalize) and a.model.fc.out_features == 3
    assert torch.equal(a.model.fc.weight, b.model.fc.weight) and a.spec == spec
    x = torch.rand(2, 1, 4, 4)
    assert torch.allclose(a(x), a.model((x - 0.5) / 0.25))
    with pytest.raises(ConfigError, match="act apply to leakbench's model families"):
        lb.build(spec, input_shape=(1, 4, 4), classes=3, act="tanh")


def test_weights_file_loads_into_the_normalised_model_and_model_files_never_name_code(spec, tmp_path):
    plain = lb.build(spec, input_shape=(1, 4, 4), classes=3, seed=2)
    torch.save(plain.state_dict(), tmp_path / "w.pt")
    wrapped = lb.build(spec, input_shape=(1, 4, 4), classes=3, seed=3, normalize=([0.5], [0.25]))
    load_weights(wrapped, tmp_path / "w.pt")
    assert torch.equal(wrapped.model.fc.weight, plain.fc.weight)
    with pytest.raises(ConfigError, match="never makes leakbench import code"):
        save_model(plain, tmp_path / "m.pt")
    net = lb.build("mlp:4", input_shape=(1, 4, 4), classes=3, seed=0)
    save_model(net, tmp_path / "m.pt")
    payload = torch.load(tmp_path / "m.pt", weights_only=True)
    payload["spec"] = spec
    torch.save(payload, tmp_path / "m.pt")
    with pytest.raises(ConfigError, match="never makes leakbench import code"):
        load_model(tmp_path / "m.pt")
