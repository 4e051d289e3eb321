"""Image and text side by side in one sweep: which dataset, model and attack belong together.

A dataset's modality is in its registry entry (:func:`leakbench.data.modality`: ``text`` holds token ids,
every other dataset images), an attack's in its class (``Attack.modality``: ``dager``, ``tag`` and ``lamp``
reconstruct text), a model's in its spec family (``gpt:``/``bert:`` read token ids; the image zoo reads
pixels; your own class is trusted with either).  A sweep crosses every dataset with every model and attack;
the pairs of different modalities are trials with status ``n/a`` and the reason (as an attack that does not
apply to a model), and a spec where an attack or a model fits none of the datasets is refused at spec-check
time (:func:`check_modalities`) with the field to change.
"""
from __future__ import annotations

from ...errors import ConfigError

__all__ = ["dataset_modality", "model_modality", "attack_modality", "pair_refusal", "check_modalities", "is_mismatch"]


def dataset_modality(name: str) -> str:
    """``"text"`` or ``"image"`` for the registered dataset ``name``."""
    from ...data import modality

    return modality(name)


def model_modality(spec: str) -> str | None:
    """``"text"`` for ``gpt:``/``bert:`` specs, ``"image"`` for the image zoo, None for your own class (either)."""
    from ...models import MODELS
    from ...models.custom import is_class_spec
    from ...models.spec import _TEXT_KEYS

    family = str(spec).split(":", 1)[0].strip()
    if family in _TEXT_KEYS:
        return "text"
    if is_class_spec(str(spec), MODELS.names()):
        return None
    return "image"


def attack_modality(name: str) -> str:
    """What the registered attack ``name`` reconstructs (its class's ``modality``)."""
    from ...attacks import ATTACKS

    return str(getattr(ATTACKS.get(name), "modality", "image"))


_WHAT = {"image": "images", "text": "token sequences"}
#: how every modality refusal ends (the report lists such pairs under "not applicable" only)
_MISMATCH = "not applicable (pair them with include rules"


def is_mismatch(reason: str | None) -> bool:
    """True for the reason :func:`pair_refusal` gives (an image model or attack paired with text, or back)."""
    return bool(reason) and _MISMATCH in str(reason)


def pair_refusal(dataset: str, model: str, attack: str | None = None) -> str | None:
    """Why ``attack`` (or, with None, a utility run) cannot run on ``model`` with ``dataset``; None when it can."""
    data = dataset_modality(dataset)
    kind = model_modality(model)
    if kind is not None and kind != data:
        return (f"model {model!r} reads {_WHAT[kind]} and dataset {dataset!r} holds {_WHAT[data]}: {_MISMATCH}, "
                "e.g. {dataset: text, model: gpt})")
    if attack:
        wants = attack_modality(attack)
        if wants != data:
            return (f"attack {attack!r} reconstructs {_WHAT[wants]} and dataset {dataset!r} holds {_WHAT[data]}: "
                    f"{_MISMATCH}, e.g. {{dataset: text, attack: dager}})")
    return None


def check_modalities(spec, where) -> None:
    """Refuse a gradient attack or a model that fits none of the spec's datasets (a :class:`ConfigError` naming
    the field); pairs of different modalities in a mixed spec are left to the trials (``n/a``)."""
    data = {dataset_modality(d.name) for d in spec.datasets}
    names = ", ".join(d.key for d in spec.datasets)
    for i, m in enumerate(spec.models):
        kind = model_modality(m.spec)
        if kind is not None and kind not in data:
            raise ConfigError(f"{where.where(('models', i, 'spec'))}: model {m.spec!r} reads {_WHAT[kind]}, but the "
                              f"spec's datasets ({names}) hold {' and '.join(_WHAT[k] for k in sorted(data))}; "
                              f"add a dataset of {_WHAT[kind]} or use a {'gpt:/bert:' if 'text' in data else 'image'} "
                              "model")
    for i, a in enumerate(spec.attacks):
        kind = attack_modality(a.name)
        if kind not in data:
            fits = "dager, tag or lamp" if "text" in data else "an image attack (inverting-gradients, dlg...)"
            raise ConfigError(f"{where.where(('attacks', i, 'name'))}: attack {a.name!r} reconstructs {_WHAT[kind]}, "
                              f"but the spec's datasets ({names}) hold "
                              f"{' and '.join(_WHAT[k] for k in sorted(data))}; use {fits}")
