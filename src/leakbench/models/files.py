"""Models from files, read as data: a state dict for a model spec, or a leakbench model file.

Files are read with ``torch.load(weights_only=True)``, which unpickles tensors and plain containers
only, never code.  Two forms:

- a **state dict** (``torch.save(model.state_dict(), path)``), loaded into the model that
  :func:`~leakbench.models.build` makes from a spec (``--model SPEC --model-file PATH``);
- a **leakbench model file** (:func:`save_model`): the state dict with its spec, input shape, classes
  and build options, so :func:`load_model` rebuilds the model from the file alone.

TorchScript archives and pickled modules are refused: TorchScript runs code, and PyTorch's functional
API (``torch.func.functional_call``, which every attack uses to differentiate the model) refuses jitted
modules ("The stateless API can't be used with Jitted modules").  Save the ``state_dict()`` instead.
"""
from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["save_model", "load_model", "load_weights", "read_state", "file_digest", "FORMAT"]

FORMAT = "leakbench-model"
_FIX = "save it with torch.save(model.state_dict(), path) or leakbench.models.save_model(model, path)"


#: the largest single tensor a model file may declare (bytes); larger ones are refused before any copy.
MAX_TENSOR_BYTES = 2 * 1024**3


def file_digest(path: str | Path) -> str:
    """The file's SHA-256 (hex, first 16 digits): it keys cached trained models and stored trials."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _read(path: str | Path, field: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"no model file at {str(file)!r} ({field}); give the path of a saved state dict")
    try:
        with warnings.catch_warnings():  # torch's note on TorchScript archives: refused below with the fix
            warnings.filterwarnings("ignore", message=".*TorchScript archive.*")
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch's refusal (UnpicklingError), a truncated or foreign file: one message
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "TorchScript" in str(err):
            raise ConfigError(f"{str(file)!r} is a TorchScript archive ({field}): attacks differentiate the model "
                              "with torch.func, which cannot run jitted modules; " + _FIX) from None
        raise ConfigError(f"cannot read {str(file)!r} as tensors only ({field}): {first[:200]}; only state dicts "
                          "are read (files are data, never code): " + _FIX) from None


def read_state(path: str | Path, *, field: str = "model file") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, metadata) of a state-dict file or a leakbench model file (metadata empty for the former)."""
    raw = _read(path, field)
    if isinstance(raw, Mapping) and raw.get("format") == FORMAT:
        state, meta = raw.get("state_dict"), {k: v for k, v in raw.items() if k != "state_dict"}
    else:
        state, meta = raw, {}
    if not isinstance(state, Mapping) or not state or \
            not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ConfigError(f"expected {str(path)!r} to hold a state dict (parameter names → tensors) ({field}); "
                          f"got {type(state).__name__}: " + _FIX)
    for k, v in state.items():
        if v.layout != torch.strided or v.is_quantized or v.device.type == "meta":
            raise ConfigError(f"expected dense tensors in {str(path)!r} ({field}), got a {v.layout} "
                              f"{'quantized ' if v.is_quantized else ''}{v.device.type} tensor {k!r}; save "
                              "{name: t.to_dense().contiguous() for name, t in state.items()}")
        need = v.numel() * v.element_size()
        if need > MAX_TENSOR_BYTES or need > v.untyped_storage().nbytes() - v.storage_offset() * v.element_size():
            raise ConfigError(f"tensor {k!r} in {str(path)!r} declares shape {tuple(v.shape)} ({need:,} bytes) "
                              f"but stores {v.untyped_storage().nbytes():,} bytes ({field}): an expanded or "
                              "oversized tensor; save each tensor with .contiguous() (at most "
                              f"{MAX_TENSOR_BYTES // 1024**3} GiB)")
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ConfigError(f"the model file {str(path)!r} holds NaN/inf in {bad[:3]} ({field})")
    return dict(state), meta


def load_weights(model: nn.Module, path: str | Path, *, field: str = "model file") -> nn.Module:
    """Load the state dict in ``path`` into ``model`` (in place, returned), naming what does not fit."""
    from .custom import is_normalized

    state, _ = read_state(path, field=field)
    if is_normalized(model) and not any(k.startswith("normalize.") for k in state):
        model = model.model  # the user's weights, saved without leakbench's normalisation in front
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    shapes = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or extra or shapes:
        spec = getattr(model, "spec", type(model).__name__)
        parts = ([f"missing {missing[:3]}{' …' if len(missing) > 3 else ''}"] if missing else []) + \
                ([f"unexpected {extra[:3]}{' …' if len(extra) > 3 else ''}"] if extra else []) + shapes[:3]
        raise ConfigError(f"the weights in {str(path)!r} do not fit model {spec!r} ({field}): {'; '.join(parts)}; "
                          "give the spec the weights were trained with (--model / the model entry's spec)")
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None else None
    model.load_state_dict({k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
                           for k, v in state.items()})
    return model


def _no_class(spec: Any, where: str) -> None:
    """A model file is data: refuse one whose spec names code to import (``module:Class``)."""
    from .custom import is_class_spec
    from .spec import MODELS

    if is_class_spec(spec, MODELS.names()):
        raise ConfigError(f"{where} names the class {spec!r}: a model file never makes leakbench import code; save "
                          "the state_dict() and name the class yourself (--model / the model entry's spec, with "
                          "--model-file / file)")


def save_model(model: nn.Module, path: str | Path) -> Path:
    """Write a leakbench model built by :func:`~leakbench.models.build` (spec, shape, classes, options, weights)."""
    for name in ("spec", "input_shape", "classes"):
        if getattr(model, name, None) is None:
            raise ConfigError(f"save_model needs a model built by leakbench.build (it has no {name!r}); for any "
                              "other module save its state_dict() and give its spec when loading")
    _no_class(getattr(model, "spec", None), "save_model: the model")
    payload = {"format": FORMAT, "version": 1, "spec": str(model.spec), "input_shape": list(model.input_shape),
               "classes": int(model.classes), "build_options": dict(getattr(model, "build_options", {}) or {}),
               "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, out)
    return out


def load_model(path: str | Path, *, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the model saved by :func:`save_model` (architecture from the file, then its weights)."""
    from .spec import build

    state, meta = read_state(path)
    if not meta:
        raise ConfigError(f"{str(path)!r} is a bare state dict: it has no architecture; give its spec "
                          "(leakbench.build(spec, ...) then load_weights(model, path), or --model SPEC)")
    spec, shape, classes, options = _metadata(meta, path)
    with torch.device("meta"):  # sized first without memory: the file's metadata must match its weights
        try:
            probe = build(spec, input_shape=shape, classes=classes, device="meta", **options)
        except (ConfigError, TypeError, ValueError, RuntimeError) as err:
            raise ConfigError(f"the metadata of {str(path)!r} does not build a model: "
                              f"{' '.join(str(err).split())[:200]}; re-save it with save_model") from None
    declared = sum(t.numel() for t in probe.state_dict().values())
    stored = sum(t.numel() for t in state.values())
    if declared != stored:
        raise ConfigError(f"the metadata of {str(path)!r} declares a model of {declared:,} values, its weights hold "
                          f"{stored:,} (spec {spec!r}, input_shape {shape}, classes {classes}); re-save it with "
                          "save_model")
    model = build(spec, input_shape=shape, classes=classes, device=device, **options)
    return load_weights(model, path)


def _metadata(meta: Mapping[str, Any], path: str | Path) -> tuple[str, tuple[int, ...], int, dict[str, Any]]:
    """(spec, input_shape, classes, build options) of a model file's metadata, checked for types and sizes."""
    spec, shape, classes, options = (meta.get("spec"), meta.get("input_shape"), meta.get("classes"),
                                     meta.get("build_options") or {})
    ok = (isinstance(spec, str) and 0 < len(spec) <= 1000 and isinstance(shape, (list, tuple)) and 1 <= len(shape) <= 4
          and all(isinstance(s, int) and not isinstance(s, bool) and 0 < s <= 1 << 16 for s in shape)
          and isinstance(classes, int) and not isinstance(classes, bool) and 1 <= classes <= 1 << 16
          and isinstance(options, Mapping) and all(isinstance(k, str) for k in options))
    if not ok:
        raise ConfigError(f"expected model-file metadata spec (text), input_shape (1–4 sizes ≤ 65536), classes "
                          f"(1..65536) and build_options (a mapping), got spec={str(spec)[:60]!r}, "
                          f"input_shape={str(shape)[:60]}, classes={str(classes)[:30]} in {str(path)!r}; re-save "
                          "it with save_model")
    _no_class(spec, f"the metadata of {str(path)!r}")
    return spec, tuple(shape), classes, dict(options)
