"""File datasets read back generated CIFAR pickles, IDX files, image folders and npz files exactly."""
from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from leakbench.data import cifar, idx, load
from leakbench.errors import ConfigError, DataNotFound

RNG = np.random.default_rng(0)
BENCHMARK_NPZ = Path("/work/shared/data/cifar10-test-1000.npz")


# ------------------------------------------------------------------ CIFAR
def write_cifar_batch(
    path: Path, n: int, label_keys: dict[str, int], *, bytes_keys: bool = True, protocol: int = 2
) -> dict:
    """One CIFAR python batch of ``n`` random images; returns what was written."""
    data = RNG.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    batch = {"data": data, "filenames": [f"img{i}.png" for i in range(n)]}
    for key, k in label_keys.items():
        batch[key] = RNG.integers(0, k, size=n).tolist()
    stored = {(k.encode() if bytes_keys else k): v for k, v in batch.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(stored, f, protocol=protocol)
    return batch


def fake_cifar10(root: Path, n: int = 4) -> tuple[list[dict], dict]:
    folder = root / "cifar-10-batches-py"
    train = [write_cifar_batch(folder / f"data_batch_{i}", n, {"labels": 10}) for i in range(1, 6)]
    test = write_cifar_batch(folder / "test_batch", n, {"labels": 10}, bytes_keys=False, protocol=5)
    return train, test


def test_cifar10_reads_pickles_exactly(tmp_path):
    train, test = fake_cifar10(tmp_path)
    data = load("cifar10", root=tmp_path)
    assert data.shape == (3, 32, 32) and len(data) == 20 and data.classes[0] == "airplane"
    raw = np.concatenate([b["data"] for b in train])
    expected = torch.from_numpy(raw.reshape(20, 3, 32, 32).astype(np.float32) / 255)
    assert torch.equal(data.images, expected)
    # channel planes: the first 1024 bytes are red, row-major
    assert data.images[0, 0, 0, 1] == float(raw[0, 1]) / 255 and data.images[0, 1, 0, 0] == float(raw[0, 1024]) / 255
    assert data.labels.tolist() == sum((b["labels"] for b in train), [])
    test_data = load("cifar10", root=tmp_path / "cifar-10-batches-py", train=False)  # root may be the folder itself
    assert test_data.labels.tolist() == test["labels"] and len(test_data) == 4


def test_cifar10_limit_and_vehicles_animals(tmp_path):
    train, _ = fake_cifar10(tmp_path)
    data = load("cifar10", root=tmp_path, limit=6, binary="vehicles-animals")
    assert len(data) == 6 and data.classes == ["animal", "vehicle"]
    original = (train[0]["labels"] + train[1]["labels"])[:6]
    assert data.labels.tolist() == [int(c in (0, 1, 8, 9)) for c in original]
    assert data.signed_labels().tolist() == [1.0 if c in (0, 1, 8, 9) else -1.0 for c in original]


def test_cifar100_fine_and_coarse(tmp_path):
    folder = tmp_path / "cifar-100-python"
    train = write_cifar_batch(folder / "train", 6, {"fine_labels": 100, "coarse_labels": 20})
    test = write_cifar_batch(folder / "test", 3, {"fine_labels": 100, "coarse_labels": 20})
    fine = load("cifar100", root=tmp_path)
    assert fine.num_classes == 100 and fine.labels.tolist() == train["fine_labels"]
    assert fine.classes[0] == "apple" and fine.classes[-1] == "worm"
    coarse = load("cifar100", root=tmp_path, train=False, coarse=True)
    assert coarse.num_classes == 20 and coarse.labels.tolist() == test["coarse_labels"]
    assert torch.equal(coarse.images.flatten(1) * 255, torch.from_numpy(test["data"]).float())


def test_cifar_missing_files_message(tmp_path):
    with pytest.raises(DataNotFound) as info:
        load("cifar10", root=tmp_path)
    msg = str(info.value)
    assert str(tmp_path) in msg and "data_batch_1" in msg and "download=True" in msg
    assert "cifar-10-batches-py" in msg


def test_cifar_refuses_pickles_that_run_code(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({"data": os.getcwd}, f)  # a reference to a callable: not a plain array
    with pytest.raises(ConfigError, match="not a CIFAR python batch"):
        load("cifar10", root=tmp_path, train=False)


def cifar_archive(tmp_path: Path) -> bytes:
    src = tmp_path / "src"
    fake_cifar10(src, n=2)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return buffer.getvalue()


def test_cifar_download_extracts_checked_archive(tmp_path, monkeypatch):
    blob = cifar_archive(tmp_path)
    spec = dict(cifar._CIFAR["cifar10"], md5=hashlib.md5(blob).hexdigest())
    monkeypatch.setitem(cifar._CIFAR, "cifar10", spec)
    urls = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda req, timeout: urls.append(req.full_url) or io.BytesIO(blob))
    root = tmp_path / "root"
    data = load("cifar10", root=root, download=True, train=False)
    assert len(data) == 2 and urls == [spec["url"]]
    assert (root / "cifar-10-python.tar.gz").is_file()
    load("cifar10", root=root, download=True, train=False)  # present now: no second download
    assert len(urls) == 1


def test_cifar_download_rejects_bad_md5(tmp_path, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", lambda req, timeout: io.BytesIO(b"not the archive"))
    with pytest.raises(DataNotFound, match="md5"):
        load("cifar10", root=tmp_path, download=True)
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


def test_download_failure_is_one_clear_error(tmp_path, monkeypatch):
    def offline(req, timeout):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DataNotFound) as info:
        load("cifar100", root=tmp_path, download=True)
    msg = str(info.value)
    assert "could not download" in msg and "name resolution" in msg and str(tmp_path) in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(DataNotFound, match="any mirror"):
        load("mnist", root=tmp_path, download=True)


# ------------------------------------------------------------------ IDX
def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    return header + array.astype(np.uint8).tobytes()


def write_idx_set(folder: Path, prefix: str, n: int, *, gz: bool) -> tuple[np.ndarray, np.ndarray]:
    images = RNG.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = RNG.integers(0, 10, size=n, dtype=np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    for kind, arr in (("images-idx3", images), ("labels-idx1", labels)):
        name = f"{prefix}-{kind}-ubyte"
        if gz:
            with gzip.open(folder / (name + ".gz"), "wb") as f:
                f.write(idx_bytes(arr))
        else:
            (folder / name).write_bytes(idx_bytes(arr))
    return images, labels


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_idx_exactly(tmp_path, gz):
    images, labels = write_idx_set(tmp_path, "train", 7, gz=gz)
    data = load("mnist", root=tmp_path)
    assert data.shape == (1, 28, 28) and data.classes == [str(k) for k in range(10)]
    assert torch.equal(data.images[:, 0] * 255, torch.from_numpy(images).float())
    assert data.labels.tolist() == labels.tolist()
    binary = load("mnist", root=tmp_path, binary="odd-even", limit=5)
    assert binary.classes == ["even", "odd"] and binary.labels.tolist() == (labels[:5] % 2).tolist()


def test_fashion_mnist_in_torchvision_layout(tmp_path):
    images, labels = write_idx_set(tmp_path / "FashionMNIST" / "raw", "t10k", 3, gz=True)
    data = load("fashion-mnist", root=tmp_path, train=False)
    assert data.classes[9] == "Ankle boot" and data.labels.tolist() == labels.tolist()
    assert torch.equal(data.images[:, 0] * 255, torch.from_numpy(images).float())
    with pytest.raises(DataNotFound) as info:
        load("fashion-mnist", root=tmp_path)  # only the test split exists
    msg = str(info.value)
    assert "train-images-idx3-ubyte" in msg and str(tmp_path / "FashionMNIST" / "raw") in msg
    assert "download=True" in msg


def test_read_idx_types_and_corruption(tmp_path):
    floats = np.arange(6, dtype=">f4").reshape(2, 3)
    (tmp_path / "f").write_bytes(bytes([0, 0, 0x0D, 2]) + np.array([2, 3], ">u4").tobytes() + floats.tobytes())
    out = idx.read_idx(tmp_path / "f")
    assert out.shape == (2, 3) and out.dtype == np.float32 and out.tolist() == floats.tolist()
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ConfigError, match="magic"):
        idx.read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(idx_bytes(np.zeros((2, 2, 2)))[:-1])
    with pytest.raises(ConfigError, match="expected 8"):
        idx.read_idx(tmp_path / "short")
    (tmp_path / "broken.gz").write_bytes(b"not gzip")
    with pytest.raises(ConfigError, match="cannot read"):
        idx.read_idx(tmp_path / "broken.gz")


# ------------------------------------------------------------------ folder
def write_png(path: Path, array: np.ndarray) -> None:
    from skimage.io import imsave

    path.parent.mkdir(parents=True, exist_ok=True)
    imsave(path, array, check_contrast=False)


def test_folder_reads_pngs_exactly(tmp_path):
    cats = [RNG.integers(0, 256, size=(8, 8, 3), dtype=np.uint8) for _ in range(2)]
    dog = RNG.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    write_png(tmp_path / "cat" / "a.png", cats[0])
    write_png(tmp_path / "cat" / "b.png", cats[1])
    write_png(tmp_path / "dog" / "c.png", dog)
    (tmp_path / "dog" / "notes.txt").write_text("ignored")
    data = load("folder", root=tmp_path)
    assert data.classes == ["cat", "dog"] and data.labels.tolist() == [0, 0, 1] and data.shape == (3, 8, 8)
    expected = torch.from_numpy(np.stack(cats + [dog]).transpose(0, 3, 1, 2).astype(np.float32) / 255)
    torch.testing.assert_close(data.images, expected, atol=1e-6, rtol=0)


def test_folder_resizes_and_converts_channels(tmp_path):
    write_png(tmp_path / "a" / "grey.png", np.full((10, 6), 200, dtype=np.uint8))
    write_png(tmp_path / "b" / "rgba.png", np.full((20, 20, 4), 100, dtype=np.uint8))
    with pytest.raises(ConfigError, match="size"):
        load("folder", root=tmp_path)
    data = load("folder", root=tmp_path, size=16)
    assert data.shape == (3, 16, 16)  # colour present, so grey is repeated
    torch.testing.assert_close(data.images[0], torch.full((3, 16, 16), 200 / 255), atol=1e-5, rtol=0)
    torch.testing.assert_close(data.images[1], torch.full((3, 16, 16), 100 / 255), atol=1e-5, rtol=0)
    grey = load("folder", root=tmp_path, size=4, channels=1, limit=1)
    assert grey.shape == (1, 4, 4) and len(grey) == 1


def test_folder_flat_is_unlabelled_and_one_class_loads(tmp_path):
    flat = [RNG.integers(0, 256, size=(6, 6), dtype=np.uint8) for _ in range(3)]
    for i, img in enumerate(flat):
        write_png(tmp_path / "flat" / f"{i}.png", img)
    data = load("folder", root=tmp_path / "flat")
    assert data.classes == ["unknown"] and data.num_classes == 1 and not data.labels_known
    assert data.labels.tolist() == [0, 0, 0] and data.shape == (1, 6, 6)
    assert data.subset([0, 1]).labels_known is False
    write_png(tmp_path / "one" / "only" / "a.png", flat[0])
    one = load("folder", root=tmp_path / "one")
    assert one.classes == ["only"] and one.num_classes == 1 and one.labels_known
    write_png(tmp_path / "flat" / "cls" / "b.png", flat[1])
    with pytest.raises(ConfigError, match="class sub-folders or a flat folder"):
        load("folder", root=tmp_path / "flat")


def test_folder_without_images_names_the_directory(tmp_path):
    (tmp_path / "empty_class").mkdir()
    with pytest.raises(DataNotFound, match=str(tmp_path)):
        load("folder", root=tmp_path)


# ------------------------------------------------------------------ npz
@pytest.mark.parametrize("layout", ["nhwc", "nchw", "nhw"])
def test_npz_layouts(tmp_path, layout):
    base = RNG.integers(0, 256, size=(5, 3 if layout != "nhw" else 1, 6, 6), dtype=np.uint8)
    x = {"nhwc": base.transpose(0, 2, 3, 1), "nchw": base, "nhw": base[:, 0]}[layout]
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(5) % 2)
    data = load("npz", path=tmp_path / "d.npz")
    assert data.shape == base.shape[1:] and data.name == "d" and data.classes == ["0", "1"]
    assert torch.equal(data.images * 255, torch.from_numpy(base).float())


def test_npz_floats_labels_and_classes(tmp_path):
    x = RNG.random((4, 2, 2, 3)).astype(np.float32)
    np.savez(tmp_path / "f.npz", x=x, y=np.array([-1, 1, 1, -1]))
    data = load("npz", path=str(tmp_path / "f.npz"))
    assert torch.equal(data.images, torch.from_numpy(x.transpose(0, 3, 1, 2).copy()))
    assert data.classes == ["-1", "+1"] and data.labels.tolist() == [0, 1, 1, 0]
    np.savez(tmp_path / "c.npz", x=x, y=np.array([0, 2, 1, 0]), classes=np.array(["a", "b", "c"]))
    assert load("npz", path=tmp_path / "c.npz").classes == ["a", "b", "c"]
    named = load("npz", path=tmp_path / "c.npz", classes=["x", "y", "z"], limit=2)
    assert named.classes == ["x", "y", "z"] and len(named) == 2
    with pytest.raises(ConfigError, match="classes"):
        load("npz", path=tmp_path / "c.npz", classes=["x"])


def test_npz_errors(tmp_path):
    with pytest.raises(DataNotFound, match=str(tmp_path / "absent.npz")):
        load("npz", path=tmp_path / "absent.npz")
    np.savez(tmp_path / "noy.npz", x=np.zeros((2, 4, 4), np.uint8))
    with pytest.raises(ConfigError, match="'y'"):
        load("npz", path=tmp_path / "noy.npz")
    np.savez(tmp_path / "range.npz", x=np.full((2, 4, 4), 2.0), y=np.zeros(2, int))
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        load("npz", path=tmp_path / "range.npz")
    np.savez(tmp_path / "amb.npz", x=np.zeros((2, 5, 5, 5), np.uint8), y=np.arange(2))
    with pytest.raises(ConfigError, match="layout"):
        load("npz", path=tmp_path / "amb.npz")
    assert load("npz", path=tmp_path / "amb.npz", layout="nchw").shape == (5, 5, 5)


@pytest.mark.skipif(not BENCHMARK_NPZ.is_file(), reason="benchmark file absent (only on the project machine)")
def test_benchmark_cifar10_npz():
    data = load("npz", path=BENCHMARK_NPZ, classes=cifar.CIFAR10_CLASSES)
    assert len(data) == 1000 and data.shape == (3, 32, 32) and data.classes[9] == "truck"
    assert data.class_counts().tolist() == [100] * 10
    assert 0.4 < float(data.images.mean()) < 0.6
