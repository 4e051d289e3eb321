"""Where file datasets live, and fetching the official archives (md5-checked, extracted safely).

The default root is ``$LEAKBENCH_DATA`` or ``~/.cache/leakbench/data``.  :func:`fetch` downloads
through a ``.part`` file and raises :class:`~leakbench.errors.DataNotFound` — saying where to put a
copy by hand — on any network, disk or checksum failure; :func:`extract_tar` refuses members that
would land outside the root.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import ConfigError, DataNotFound

__all__ = ["PathLike", "default_root", "data_root", "fetch", "md5_of", "extract_tar"]

PathLike = str | os.PathLike


def default_root() -> Path:
    """Where file datasets live unless ``root`` is given: ``$LEAKBENCH_DATA`` or ``~/.cache/leakbench/data``."""
    return Path(os.environ.get("LEAKBENCH_DATA") or Path.home() / ".cache" / "leakbench" / "data")


def data_root(root: PathLike | None) -> Path:
    if root is None:
        return default_root().expanduser()
    if not isinstance(root, (str, os.PathLike)):
        raise ConfigError(f"expected a directory path, got {root!r} (field root)")
    return Path(root).expanduser()


def md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(url: str, dest: Path, *, md5: str | None = None, timeout: float = 60.0) -> Path:
    """Fetch ``url`` to ``dest`` (via a ``.part`` file), checking ``md5``; DataNotFound on any failure."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "leakbench"})
        with urllib.request.urlopen(request, timeout=timeout) as response, open(part, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:  # HTTP, timeouts, DNS, disk
        part.unlink(missing_ok=True)
        reason = getattr(exc, "reason", None) or exc
        raise DataNotFound(
            f"could not download {url} ({reason}); download it by hand and put it in {dest.parent}"
        ) from None
    if md5 is not None and md5_of(part) != md5:
        part.unlink(missing_ok=True)
        raise DataNotFound(
            f"downloaded {url} but its md5 does not match {md5} (corrupt or changed file); "
            f"retry, or put a good copy at {dest}"
        )
    part.replace(dest)
    return dest


def extract_tar(archive: Path, root: Path) -> None:
    with tarfile.open(archive, "r:gz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, filter="data")
        else:  # pragma: no cover - Python without extraction filters
            base = root.resolve()
            for member in tar.getmembers():
                target = (root / member.name).resolve()
                if base not in target.parents and target != base:
                    raise DataNotFound(f"refusing to extract {member.name!r} outside {root} from {archive}")
            tar.extractall(root)
