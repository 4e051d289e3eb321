"""ImageDataset: validation, properties, seeded batches, subsets and statistics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from leakbench.data import ImageDataset
from leakbench.errors import ConfigError


def make(n_per_class=(5, 5, 5, 5), shape=(3, 4, 4), seed=0) -> ImageDataset:
    """Images whose first pixel encodes the sample index, so batches can be traced back."""
    labels = torch.cat([torch.full((n,), k, dtype=torch.int64) for k, n in enumerate(n_per_class)])
    gen = torch.Generator().manual_seed(seed)
    images = torch.rand((len(labels), *shape), generator=gen)
    return ImageDataset(images, labels, [f"c{k}" for k in range(len(n_per_class))], "toy")


def index_of(data: ImageDataset, x: torch.Tensor) -> list[int]:
    """Positions in ``data`` of the rows of ``x``."""
    flat = data.images.reshape(len(data), -1)
    return [int(torch.nonzero((flat == row).all(dim=1))[0]) for row in x.reshape(len(x), -1)]


# ------------------------------------------------------------------ construction and properties
def test_properties_of_image_and_vector_data():
    img = make()
    assert img.shape == (3, 4, 4) and img.is_image and len(img) == 20 and img.num_classes == 4
    vec = ImageDataset(torch.randn(6, 5), torch.tensor([0, 1, 0, 1, 0, 1]), ["a", "b"], "vec")
    assert vec.shape == (5,) and not vec.is_image and len(vec) == 6
    assert "n=6" in repr(vec) and "shape=(5,)" in repr(vec)


def test_constructor_converts_dtypes():
    data = ImageDataset(np.zeros((2, 1, 2, 2), dtype=np.float64), np.array([0, 1], dtype=np.int32), ["a", "b"])
    assert data.images.dtype == torch.float32 and data.labels.dtype == torch.int64


@pytest.mark.parametrize(
    "images, labels, classes, field",
    [
        (torch.zeros(3, 4, 4), torch.zeros(3, dtype=torch.int64), ["a"], "images"),  # 3-D
        (torch.zeros(3, 1, 2, 2), torch.zeros(2, dtype=torch.int64), ["a"], "labels"),  # count
        (torch.zeros(2, 1, 2, 2), torch.tensor([0, 2]), ["a", "b"], "labels"),  # out of range
        (torch.zeros(2, 1, 2, 2), torch.tensor([0.0, 1.0]), ["a", "b"], "labels"),  # float labels
        (torch.zeros(2, 1, 2, 2), torch.tensor([0, 0]), [], "classes"),
    ],
)
def test_constructor_rejects_bad_input(images, labels, classes, field):
    with pytest.raises(ConfigError, match=field):
        ImageDataset(images, labels, classes)


def test_mean_and_std_per_channel_and_per_feature():
    data = make()
    x = data.images.permute(1, 0, 2, 3).reshape(3, -1)
    torch.testing.assert_close(data.mean, x.mean(dim=1))
    torch.testing.assert_close(data.std, x.std(dim=1, correction=0))
    assert data.mean.shape == (3,)
    vec = ImageDataset(torch.tensor([[1.0, 10.0], [3.0, 30.0]]), torch.tensor([0, 1]), ["a", "b"])
    torch.testing.assert_close(vec.mean, torch.tensor([2.0, 20.0]))
    torch.testing.assert_close(vec.std, torch.tensor([1.0, 10.0]))


def test_signed_labels_map_class0_to_minus_one():
    data = ImageDataset(torch.zeros(4, 2), torch.tensor([0, 1, 1, 0]), ["neg", "pos"])
    s = data.signed_labels()
    assert s.dtype == torch.float32 and s.tolist() == [-1.0, 1.0, 1.0, -1.0]
    with pytest.raises(ConfigError, match="binary"):
        make().signed_labels()


def test_subset_and_to_keep_metadata():
    data = make()
    sub = data.subset([3, 0, 3])
    assert len(sub) == 3 and sub.classes == data.classes and sub.name == "toy"
    assert torch.equal(sub.images[1], data.images[0]) and torch.equal(sub.images[0], sub.images[2])
    moved = data.to("cpu")
    assert moved is not data and torch.equal(moved.images, data.images)
    with pytest.raises(ConfigError, match="indices"):
        data.subset([0, 20])
    assert data.class_counts().tolist() == [5, 5, 5, 5]


# ------------------------------------------------------------------ batch
def test_batch_is_deterministic_and_seed_dependent():
    data = make()
    x1, y1 = data.batch(8, seed=3)
    x2, y2 = data.batch(8, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    picks = {tuple(index_of(data, data.batch(8, seed=s)[0])) for s in range(5)}
    assert len(picks) > 1


def test_batch_leaves_global_rng_alone():
    data = make()
    torch.manual_seed(123)
    np.random.seed(123)
    t_state, n_state = torch.get_rng_state(), np.random.get_state()[1].copy()
    data.batch(6, seed=1)
    data.batch(6, seed=1, balanced=False)
    data.batch(seed=1, classes=[0, 1])
    assert torch.equal(torch.get_rng_state(), t_state)
    assert np.array_equal(np.random.get_state()[1], n_state)


def test_balanced_batch_has_distinct_classes_then_round_robin():
    data = make()
    for seed in range(10):
        x, y = data.batch(4, seed=seed)
        assert sorted(y.tolist()) == [0, 1, 2, 3]
        _, y = data.batch(3, seed=seed)
        assert len(set(y.tolist())) == 3
        x, y = data.batch(12, seed=seed)
        assert torch.bincount(y, minlength=4).tolist() == [3, 3, 3, 3]
        idx = index_of(data, x)
        assert len(set(idx)) == 12  # no sample twice
        assert torch.equal(data.labels[idx], y)


def test_balanced_batch_skips_exhausted_classes():
    data = make(n_per_class=(1, 10, 10))
    _, y = data.batch(9, seed=0)
    counts = torch.bincount(y, minlength=3).tolist()
    assert counts[0] == 1 and counts[1] == 4 and counts[2] == 4


def test_unbalanced_batch_follows_class_frequencies():
    data = make(n_per_class=(90, 10))
    uniform = torch.cat([data.batch(10, seed=s, balanced=False)[1] for s in range(40)])
    balanced = torch.cat([data.batch(10, seed=s)[1] for s in range(40)])
    assert 0.8 < (uniform == 0).float().mean() < 0.98
    assert (balanced == 0).float().mean() == 0.5
    x, _ = data.batch(100, seed=0, balanced=False)
    assert sorted(index_of(data, x)) == list(range(100))


def test_batch_with_indices_returns_exactly_those():
    data = make()
    x, y = data.batch(indices=[7, 2, 19])
    assert torch.equal(x, data.images[[7, 2, 19]]) and torch.equal(y, data.labels[[7, 2, 19]])
    x2, _ = data.batch(3, indices=torch.tensor([7, 2, 19]), seed=99)
    assert torch.equal(x, x2)
    x[0].zero_()
    assert not torch.equal(data.images[7], x[0])  # a copy, not a view


def test_batch_with_classes_draws_one_sample_per_slot():
    data = make()
    x, y = data.batch(classes=[2, 0, 2, 3], seed=4)
    assert y.tolist() == [2, 0, 2, 3]
    idx = index_of(data, x)
    assert idx[0] != idx[2] and data.labels[idx].tolist() == [2, 0, 2, 3]
    assert torch.equal(data.batch(classes=[2, 0, 2, 3], seed=4)[0], x)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"size": 21}, "size"),
        ({"size": 0}, "size"),
        ({"size": 2.5}, "size"),
        ({"size": None}, "size"),
        ({"indices": [0, 20]}, "indices"),
        ({"indices": [-1]}, "indices"),
        ({"indices": [0.5, 1.0]}, "indices"),
        ({"indices": []}, "indices"),
        ({"size": 2, "indices": [1, 2, 3]}, "size"),
        ({"classes": [4]}, "classes"),
        ({"classes": [0] * 6}, "classes"),
        ({"size": 3, "classes": [0, 1]}, "size"),
        ({"indices": [0], "classes": [0]}, "indices"),
        ({"size": 2, "seed": -1}, "seed"),
    ],
)
def test_batch_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        make().batch(**kwargs)


def test_batch_of_class_without_samples_is_an_error():
    data = ImageDataset(torch.zeros(3, 2), torch.tensor([0, 0, 2]), ["a", "b", "c"])
    with pytest.raises(ConfigError, match=r"class 1 \('b'\)"):
        data.batch(classes=[1])
    _, y = data.batch(2, seed=0)  # balanced draw ignores the empty class
    assert sorted(y.tolist()) == [0, 2]
