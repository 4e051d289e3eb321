"""Offline datasets (digits, photos, sphere, gaussian-mixture) and the load() front door."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from leakbench.data import DATASETS, OFFLINE, ImageDataset, load, options
from leakbench.data.offline import MIN_PATCH_STD, PHOTO_NAMES
from leakbench.errors import ConfigError


def check_images(data: ImageDataset, shape: tuple[int, ...]) -> None:
    assert isinstance(data, ImageDataset)
    assert data.images.dtype == torch.float32 and data.labels.dtype == torch.int64
    assert data.images.shape[1:] == shape and data.shape == shape
    assert float(data.images.min()) >= 0.0 and float(data.images.max()) <= 1.0
    assert int(data.labels.min()) >= 0 and int(data.labels.max()) < data.num_classes


# ------------------------------------------------------------------ registry and load()
def test_registry_lists_every_dataset():
    assert set(DATASETS.names()) == {
        "digits", "photos", "sphere", "gaussian-mixture",
        "cifar10", "cifar100", "mnist", "fashion-mnist", "folder", "npz", "text",
    }
    assert set(OFFLINE) <= set(DATASETS.names())
    assert options("digits") == {"size": 8, "channels": 1, "binary": None, "limit": None, "deform": 0.0, "seed": 0,
                                "offset": 0}


def test_unknown_dataset_lists_known_names():
    with pytest.raises(ConfigError) as info:
        load("digitz")
    message = str(info.value)
    assert "'digits'" in message and all(name in message for name in DATASETS.names())


def test_unknown_option_names_it_and_the_accepted_ones():
    with pytest.raises(ConfigError, match=r"'sise'.*accepted options: size, channels, binary, limit, deform, seed"):
        load("digits", sise=16)


def test_missing_required_option_is_named():
    with pytest.raises(ConfigError, match="'root'"):
        load("folder")


# ------------------------------------------------------------------ digits
def test_digits_native():
    data = load("digits")
    check_images(data, (1, 8, 8))
    assert len(data) == 1797 and data.classes == [str(k) for k in range(10)] and data.name == "digits"
    assert float(data.images.max()) == 1.0  # 16/16
    assert torch.bincount(data.labels).min() >= 170  # about 180 per class
    from sklearn.datasets import load_digits

    torch.testing.assert_close(data.images[:, 0], torch.from_numpy(load_digits().images / 16).float())


def test_digits_upsampled_rgb_keeps_content():
    small = load("digits", limit=50)
    big = load("digits", size=32, channels=3, limit=50)
    check_images(big, (3, 32, 32))
    assert torch.equal(big.images[:, 0], big.images[:, 2]) and torch.equal(big.labels, small.labels)
    back = F.avg_pool2d(big.images[:, :1], 4)  # block means of the upsampled image track the original
    corr = np.corrcoef(back.flatten().numpy(), small.images.flatten().numpy())[0, 1]
    assert corr > 0.9 and abs(float(back.mean() - small.images.mean())) < 0.01


def test_deformed_digits_are_linearly_independent_seeded_and_still_the_digits():
    plain = load("digits", size=28)
    warped = load("digits", size=28, deform=1.0, seed=0)
    check_images(warped, (1, 28, 28))
    assert torch.equal(warped.labels, plain.labels)
    # rank at float32 precision (singular values above 1e-6 σ_max): 256, well conditioned; upsampled alone ~55
    def rank(images):
        s = torch.linalg.svdvals(images[:256].reshape(256, -1).double())
        return int((s > 1e-6 * s[0]).sum()), float(s[-1] / s[0])

    assert rank(plain.images)[0] < 70
    full, conditioning = rank(warped.images)
    assert full == 256 and conditioning > 1e-4
    assert torch.equal(load("digits", size=28, deform=1.0, seed=0, limit=40).images, warped.images[:40])
    assert not torch.equal(load("digits", size=28, deform=1.0, seed=1, limit=40).images, warped.images[:40])
    # a mild warp: each image stays closer to its own digit than to the other images' (nearest neighbour)
    near = torch.cdist(warped.images[:300].flatten(1), plain.images[:300].flatten(1)).argmin(1)
    assert (plain.labels[near] == warped.labels[:300]).float().mean() > 0.8


def test_digits_odd_even():
    plain, binary = load("digits", limit=100), load("digits", binary="odd-even", limit=100)
    assert binary.classes == ["even", "odd"] and len(binary) == 100
    assert torch.equal(binary.labels, plain.labels % 2)
    assert binary.signed_labels()[plain.labels == 3].eq(1).all()


@pytest.mark.parametrize("opts, field", [({"size": 4}, "size"), ({"channels": 2}, "channels"),
                                         ({"binary": "odd"}, "binary"), ({"limit": 0}, "limit"),
                                         ({"deform": -1.0}, "deform"), ({"deform": float("nan")}, "deform"),
                                         ({"deform": 9}, "deform"), ({"seed": -1}, "seed")])
def test_digits_bad_options(opts, field):
    with pytest.raises(ConfigError, match=field):
        load("digits", **opts)


# ------------------------------------------------------------------ photos
def test_photos_default_patches():
    data = load("photos")
    check_images(data, (3, 32, 32))
    assert data.classes == list(PHOTO_NAMES) and "cat" not in data.classes
    assert (data.class_counts() > 10).all()  # every photo gives many patches
    stds = data.images.reshape(len(data), -1).std(dim=1, correction=0)
    assert float(stds.min()) >= MIN_PATCH_STD - 1e-6
    assert torch.equal(load("photos").images, data.images)  # deterministic


def test_photos_patches_are_exact_tiles_at_scale_one():
    import skimage.data

    data = load("photos", size=16, scale=1, limit=5)
    photo = skimage.data.astronaut().astype(np.float32) / 255
    tile = torch.from_numpy(photo[0:16, 16:32].transpose(2, 0, 1).copy())
    assert any(torch.allclose(p, tile, atol=1e-6) for p in data.images)  # second tile of row 0


def test_photos_per_photo_size_and_grayscale():
    data = load("photos", size=64, per_photo=3, grayscale=True)
    check_images(data, (1, 64, 64))
    assert data.class_counts().tolist() == [3] * len(PHOTO_NAMES)
    full = load("photos", size=64, grayscale=True)
    first = full.images[full.labels == 0]
    kept = data.images[data.labels == 0]
    assert torch.equal(kept[0], first[0]) and torch.equal(kept[-1], first[-1])  # evenly spaced, ends included


@pytest.mark.parametrize("opts, field", [({"size": 4}, "size"), ({"size": 5000, "scale": 1}, "size"),
                                         ({"per_photo": 0}, "per_photo"), ({"scale": 0}, "scale"),
                                         ({"grayscale": "yes"}, "grayscale")])
def test_photos_bad_options(opts, field):
    with pytest.raises(ConfigError, match=field):
        load("photos", **opts)


# ------------------------------------------------------------------ sphere
@pytest.mark.parametrize("d", [1, 3, 50])
def test_sphere_points_lie_on_radius_sqrt_d(d):
    data = load("sphere", n=200, d=d)
    assert data.shape == (d,) and not data.is_image and data.classes == ["-1", "+1"]
    torch.testing.assert_close(data.images.norm(dim=1), torch.full((200,), math.sqrt(d)))
    assert set(data.signed_labels().tolist()) <= {-1.0, 1.0}


def test_sphere_is_uniform_in_direction():
    x = load("sphere", n=4000, d=3, seed=1).images
    assert float(x.mean(dim=0).abs().max()) < 0.1  # no preferred direction
    torch.testing.assert_close(x.pow(2).mean(dim=0), torch.ones(3), atol=0.1, rtol=0)


def test_sphere_first_coordinate_rule():
    data = load("sphere", n=100, d=5, rule="first-coordinate")
    assert torch.equal(data.labels, (data.images[:, 0] > 0).long())


def test_sphere_random_halfspace_is_shared_across_seeds():
    a = load("sphere", n=300, d=2, seed=0)
    b = load("sphere", n=300, d=2, seed=1)
    x = torch.cat([a.images, b.images]).double()
    y = torch.cat([a.labels, b.labels])
    order = torch.argsort(torch.atan2(x[:, 1], x[:, 0]))
    ring = y[order]
    changes = int((ring != torch.roll(ring, 1)).sum())
    assert changes == 2  # one half-plane: each label is a single arc of the circle
    assert 0.3 < float(y.float().mean()) < 0.7
    c = load("sphere", n=300, d=2, seed=0, rule_seed=5)
    assert not torch.equal(c.labels, a.labels) and torch.equal(c.images, a.images)


def test_sphere_random_labels_are_fair_and_independent():
    data = load("sphere", n=2000, d=2, rule="random", seed=3)
    assert 0.45 < float(data.labels.float().mean()) < 0.55
    corr = np.corrcoef(data.signed_labels().numpy(), data.images[:, 0].numpy())[0, 1]
    assert abs(corr) < 0.1
    assert not torch.equal(load("sphere", n=2000, d=2, rule="random", seed=4).labels, data.labels)


def test_sphere_bad_rule():
    with pytest.raises(ConfigError, match="rule"):
        load("sphere", rule="halfspace")


# ------------------------------------------------------------------ gaussian mixture
def test_gaussian_mixture_geometry():
    data = load("gaussian-mixture", n=3000, d=4, classes=3, separation=5.0, std=0.5, seed=2)
    assert data.shape == (4,) and data.num_classes == 3 and data.name == "gaussian-mixture"
    assert data.class_counts().tolist() == [1000, 1000, 1000]
    means = torch.stack([data.images[data.labels == k].mean(dim=0) for k in range(3)])
    dist = torch.cdist(means, means)
    torch.testing.assert_close(dist[0, 1], torch.tensor(5.0), atol=0.1, rtol=0)
    torch.testing.assert_close(dist[1, 2], torch.tensor(5.0), atol=0.1, rtol=0)
    spread = torch.cat([data.images[data.labels == k] - means[k] for k in range(3)]).std(dim=0)
    torch.testing.assert_close(spread, torch.full((4,), 0.5), atol=0.03, rtol=0)


def test_gaussian_mixture_seeded_and_one_dimensional():
    a, b = load("gaussian-mixture", seed=0), load("gaussian-mixture", seed=0)
    assert torch.equal(a.images, b.images) and len(a) == 200
    assert not torch.equal(load("gaussian-mixture", seed=1).images, a.images)
    line = load("gaussian-mixture", n=2000, d=1, classes=2, separation=4.0, std=0.1)
    m0, m1 = (float(line.images[line.labels == k].mean()) for k in (0, 1))
    assert abs(m0 + 2.0) < 0.05 and abs(m1 - 2.0) < 0.05


@pytest.mark.parametrize("opts, field", [({"classes": 1}, "classes"), ({"std": 0}, "std"),
                                         ({"separation": float("nan")}, "separation"), ({"n": 0}, "n")])
def test_gaussian_mixture_bad_options(opts, field):
    with pytest.raises(ConfigError, match=field):
        load("gaussian-mixture", **opts)


def test_limit_keeps_the_first_samples():
    full, cut = load("sphere", n=50), load("sphere", n=50, limit=7)
    assert len(cut) == 7 and torch.equal(cut.images, full.images[:7])
    full, cut = load("photos", size=64), load("photos", size=64, limit=9)
    assert torch.equal(cut.images, full.images[:9])


def test_digits_offset_skips_the_first_images_before_the_limit():
    full = load("digits")
    cut = load("digits", offset=1000, limit=5)
    assert torch.equal(cut.images, full.images[1000:1005]) and torch.equal(cut.labels, full.labels[1000:1005])
    assert len(load("digits", offset=1000)) == len(full) - 1000
    deformed = load("digits", deform=1.0, seed=3)       # each image keeps its own deformation
    assert torch.equal(load("digits", deform=1.0, seed=3, offset=1790).images, deformed.images[1790:])
    for bad in (-1, len(full)):
        with pytest.raises(ConfigError, match="offset"):
            load("digits", offset=bad)
