"""Issue 48: every model spec is sized before it is built; a user class is probed as attacks use it."""
from __future__ import annotations

import textwrap
import time

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError
from leakbench.models.size import MAX_MODEL_BYTES, check_size


@pytest.mark.parametrize("spec, shape, classes", [
    ("gpt:layers=64,width=8192,heads=8", (16,), 50_000),          # 51 G parameters, every key within its cap
    ("bert:layers=40,width=8192,heads=64,vocab=1000", (16,), 2),
    ("mlp:100000-100000", (1, 8, 8), 10),
    ("cnn:3-4096-1-1,3-4096-1-1", (3, 256, 256), 10),               # the linear layer after two wide convs
    ("convnet-4096", (3, 32, 32), 10),
])
def test_an_oversized_spec_is_refused_before_it_is_built(spec, shape, classes):
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="expected a model of at most .* GiB.*got"):
        lb.build(spec, input_shape=shape, classes=classes)
    assert time.perf_counter() - start < 2.0  # counted on the meta device: nothing allocated


def test_the_size_counts_the_dtype_and_normal_models_pass():
    model = lb.build("gpt:layers=2,width=64,heads=4", input_shape=(16,), classes=100, seed=0)
    numbers = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()
                                                               if b.is_floating_point())
    make = lambda: torch.nn.Linear(1000, 1000)  # noqa: E731
    assert check_size(make, "lin", torch.float64) == 2 * check_size(make, "lin", torch.float32)
    assert numbers < MAX_MODEL_BYTES
    with pytest.raises(ConfigError, match="at most 0.001 GiB"):
        check_size(make, "lin", limit=2**30 // 1000)


CLASSES = textwrap.dedent('''
    import torch
    from torch import nn

    class Huge(nn.Module):
        def __init__(self, input_shape, classes):
            super().__init__()
            self.fc = nn.Linear(200_000, 200_000)

        def forward(self, x):
            return self.fc(x)

    class Flat(nn.Module):  # fine on one sample only: view(1, -1)
        def __init__(self, input_shape, classes):
            super().__init__()
            self.fc = nn.Linear(16, classes)

        def forward(self, x):
            return self.fc(x.view(1, -1))

    class Ints(nn.Module):  # integer "logits"
        def __init__(self, input_shape, classes):
            super().__init__()
            self.fc = nn.Linear(16, classes)

        def forward(self, x):
            return self.fc(x.flatten(1)).round().long()

    class Pair(nn.Module):  # (logits, aux) in train mode only
        def __init__(self, input_shape, classes):
            super().__init__()
            self.fc = nn.Linear(16, classes)
            self.bn = nn.BatchNorm1d(16)

        def forward(self, x):
            z = self.fc(self.bn(x.flatten(1)))
            return (z, z) if self.training else z
''')


@pytest.fixture
def module(tmp_path, monkeypatch):
    name = f"owncls_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(CLASSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_user_class_is_sized_before_it_is_built(module):
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="expected a model of at most"):
        lb.build(f"{module}:Huge", input_shape=(1, 4, 4), classes=3)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("cls, match", [
    ("Flat", "fails in eval mode on a batch of shape \\(2, 1, 4, 4\\)"),
    ("Ints", "expected model .* to return float logits, got dtype torch.int64"),
    ("Pair", "in train mode .* got tuple"),
])
def test_a_user_class_that_breaks_in_use_is_refused_in_one_line(module, cls, match):
    with pytest.raises(ConfigError, match=match) as err:
        lb.build(f"{module}:{cls}", input_shape=(1, 4, 4), classes=3)
    assert "\n" not in str(err.value)


def test_the_train_mode_probe_leaves_the_buffers_alone(module, tmp_path):
    src = CLASSES.replace("return (z, z) if self.training else z", "return z")
    name = f"{module}_ok"
    (tmp_path / f"{name}.py").write_text(src)
    model = lb.build(f"{name}:Pair", input_shape=(1, 4, 4), classes=3, seed=0)
    assert int(model.bn.num_batches_tracked) == 0 and torch.equal(model.bn.running_var, torch.ones(16))
