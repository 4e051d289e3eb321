"""The entries of a sweep spec's attack side: datasets, models (with their training, normalisation and malicious
server), attacks and defenses — each a strict pydantic model whose errors name the field."""
from __future__ import annotations

import itertools
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ...errors import ConfigError
from .federated import FederatedEntry

#: keys an include/exclude rule may name.
#: seeds are stored as SQLite 64-bit integers: 0 ≤ seed < 2**63.
MAX_SEED = 2**63
#: torch threads a trial may ask for (a larger value is a typo, not a machine).
MAX_THREADS = 1024
#: the most trials a spec's ``stack`` may solve as one batched call
MAX_STACK = 4096


class _Strict(BaseModel):
    # allow_inf_nan=False: no float field takes NaN or ±inf (``lr: .inf`` would fail every trial)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DatasetEntry(_Strict):
    """A dataset by registry name, with loader options (``size``, ``limit``, ``root``...)."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)
    label: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @property
    def key(self) -> str:
        """How tables and rules name this dataset."""
        if self.label:
            return self.label
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.name}({opts})" if opts else self.name


class TrainingEntry(_Strict):
    """The model's training state before it is attacked: ``epochs: 0`` is untrained."""

    epochs: int = Field(0, ge=0)
    lr: float = Field(0.05, gt=0)
    batch_size: int = Field(32, ge=1)
    seed: int = Field(0, ge=0, lt=MAX_SEED)


#: what a malicious server can ship in place of the model, and the function that builds it.
SERVER_MOVES = {"imprint": "leakbench.models.malicious.imprint",
                "random_head": "leakbench.models.malicious.random_head",
                "trap_weights": "leakbench.models.active.trap_weights",
                "fishing": "leakbench.models.active.fishing",
                "loki": "leakbench.models.loki.loki"}
#: arguments of those functions the trial sets itself (the model, its shape, the public sample).


class ServerEntry(_Strict):
    """The malicious server's move: the model it ships instead of the honest one (exactly one form).

    ``imprint: {bins: K, ...}`` puts Robbing the Fed's imprint block in front of the model
    (options of :func:`leakbench.models.malicious.imprint`); ``random_head: {width: W, ...}``
    swaps the last linear layer for Liu et al.'s partly random head (App. F; options of
    :func:`~leakbench.models.malicious.random_head`); ``trap_weights: {...}`` gives the first FC layer
    Boenisch et al.'s trap rows (``neurons: K``: a trap block in front of any model; options of
    :func:`~leakbench.models.active.trap_weights`; without ``rate`` or ``scale`` each row fires for
    1/(B·L) of the public images, B the batch and L the clients of ``secagg:L``); ``fishing: {target: c}``
    is Wen et al.'s class fishing (:func:`~leakbench.models.active.fishing`; ``quantile: q`` and optionally
    ``feature: j`` make it feature fishing, its threshold placed on the labelled public samples, which
    ``fishing-rounds`` re-queries over several rounds); ``loki: {bins: K}`` sends every
    client of ``secagg:L`` its own LOKI model (Zhao et al. 2024, :func:`~leakbench.models.loki.loki`; L from
    the defense).  ``public``: images the
    server holds (drawn from the dataset, never one of the attacked images) to place the imprint bins at
    equal-mass quantiles, calibrate the trap rows or centre the random head (``center: calibration``).
    """

    imprint: dict[str, Any] | None = None
    random_head: dict[str, Any] | None = None
    trap_weights: dict[str, Any] | None = None
    fishing: dict[str, Any] | None = None
    loki: dict[str, Any] | None = None
    public: int = Field(256, ge=2)

    @model_validator(mode="after")
    def _one_move(self) -> ServerEntry:
        given = [name for name in SERVER_MOVES if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"expected exactly one server move ({' or '.join(SERVER_MOVES)}), got "
                             f"{given or 'none'}; e.g. server: {{imprint: {{bins: 64}}}}")
        return self

    @property
    def move(self) -> tuple[str, dict[str, Any]]:
        """(name, options) of the move."""
        name = next(n for n in SERVER_MOVES if getattr(self, n) is not None)
        return name, dict(getattr(self, name))

    @property
    def key(self) -> str:
        name, options = self.move
        return f"{name}({','.join(f'{k}={v}' for k, v in sorted(options.items()))})"


class NormalizeEntry(_Strict):
    """The input normalisation x̃ = (x − mean) / std the model expects, one value per channel."""

    mean: list[float] = Field(min_length=1)
    std: list[float] = Field(min_length=1)

    @model_validator(mode="after")
    def _per_channel(self) -> NormalizeEntry:
        if len(self.mean) != len(self.std) or not all(s > 0 for s in self.std):
            raise ValueError(f"expected mean and std with one value per channel and std > 0, got {len(self.mean)} "
                             f"means and std {self.std}")
        return self


class ModelEntry(_Strict):
    """A model spec (``cnn:3-8-2-1``, ``convnet-16``...) with build options, training state and server move;
    ``file``: its weights, a state dict read as tensors only (relative paths from where the sweep runs).

    ``spec`` may name your own ``nn.Module`` class, ``my_pkg.nets:ResNet`` (imported: your choice to run
    its code; ``options`` are its constructor's keyword arguments, see :mod:`leakbench.models.custom`);
    its trials are keyed on the digest of the class's source file.  ``normalize: {mean: [...], std:
    [...]}`` puts the input normalisation in front of the model, so attacks work on pixels in [0, 1]."""

    spec: str
    file: str | None = None
    normalize: NormalizeEntry | None = None
    act: str | None = None
    init: str = "default"
    seed: int = Field(0, ge=0, lt=MAX_SEED)
    options: dict[str, Any] = Field(default_factory=dict)
    training: TrainingEntry = Field(default_factory=TrainingEntry)
    #: training as an axis: a FedAvg run per (dataset, defense, seed), attacked at chosen rounds (:mod:`.federated`)
    federated: FederatedEntry | None = None
    server: ServerEntry | None = None
    label: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"spec": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_training(self) -> ModelEntry:
        if self.federated is not None and self.training.epochs:
            raise ValueError(f"expected either training.epochs or federated: on model {self.spec!r}, got both; the "
                             "FedAvg run trains the model — remove training:")
        return self

    @property
    def key(self) -> str:
        if self.label:
            return self.label
        extra = [f"act={self.act}"] if self.act else []
        extra += [f"init={self.init}"] if self.init != "default" else []
        text = self.spec + (f"({','.join(extra)})" if extra else "")
        text += f"[{Path(self.file).name}]" if self.file else ""
        text += f"@{self.training.epochs}ep" if self.training.epochs else ""
        return text + (f"+{self.server.key}" if self.server is not None else "")

    def build_options(self) -> dict[str, Any]:
        """The trial's ``model_options``: build arguments, and the weights file with its digest (a changed file is a
        new trial)."""
        options: dict[str, Any] = {"act": self.act, "init": self.init, "seed": self.seed, "options": dict(self.options)}
        if self.normalize is not None:
            options["normalize"] = [list(self.normalize.mean), list(self.normalize.std)]
        from ...models import MODELS
        from ...models.custom import class_digest, is_class_spec

        if is_class_spec(self.spec, MODELS.names()):  # an edited class is a new trial
            options["source_digest"] = class_digest(self.spec, field="spec")
        if self.file:
            from ...models.files import file_digest

            if not Path(self.file).is_file():
                raise ConfigError(f"models: no weights file at {self.file!r} (field file of model {self.spec!r}); "
                                  "give a state dict's path, relative to where the sweep runs")
            options.update(file=self.file, file_digest=file_digest(self.file))
        return options


class AttackEntry(_Strict):
    """An attack by registry name with a preset and option overrides; ``label`` names it in tables.

    ``threat`` overrides fields of the spec's ``threat`` section for this attack's trials, so one
    sweep can hold an eavesdropper's and an informed eavesdropper's attack (``{bn_stats: true,
    labels_known: true}`` grants the BN statistics and labels Inverting Gradients can use).
    """

    name: str
    preset: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    threat: dict[str, Any] = Field(default_factory=dict)
    label: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @property
    def key(self) -> str:
        return self.label or self.name


class DefenseEntry(_Strict):
    """A defense spec, or a template with a parameter grid (``{spec: "prune:{p}", grid: {p: [0.5, 0.9]}}``).

    Shorthands: ``"clip:4+noise:0.01"`` (one setting) and ``{prune: [0.5, 0.9]}``
    (a family with one setting per value; a list value ``[1.0, 0.01]`` gives ``dpsgd:1.0,0.01``).
    """

    spec: str
    grid: dict[str, list[Any]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"spec": value}
        if isinstance(value, Mapping) and len(value) == 1 and "spec" not in value:
            (name, values), = value.items()
            if not isinstance(values, list):
                values = [values]
            return {"spec": f"{name}:{{p}}", "grid": {"p": [_arg(v) for v in values]}}
        return value

    def expand(self) -> list[str]:
        """The concrete defense specs of this entry, in grid order."""
        fields = [f for _, f, _, _ in string.Formatter().parse(self.spec) if f]
        missing = [f for f in fields if f not in self.grid]
        unused = [k for k in self.grid if k not in fields]
        if missing or unused:
            raise ValueError(f"template {self.spec!r} and grid keys {sorted(self.grid)} do not agree"
                             + (f" (no values for {missing})" if missing else "")
                             + (f" ({unused} not used in the template)" if unused else ""))
        if not fields:
            return [self.spec]
        names = list(self.grid)
        return [self.spec.format(**dict(zip(names, map(_arg, combo))))
                for combo in itertools.product(*(self.grid[n] for n in names))]


def _arg(value: Any) -> str:
    """A grid value as defense-spec text: lists join with commas."""
    if isinstance(value, (list, tuple)):
        return ",".join(_arg(v) for v in value)
    return str(value)


class UtilityEntry(_Strict):
    """Train once per (dataset, model, defense, batch size) to measure the defense's utility cost.

    With ``per_batch_size`` (default) the defended training uses each attack batch size, as in
    Liu et al.'s Table 5 (a defense costs more at B = 1 than at B = 8); otherwise once at
    ``batch_size``.  Every run sees ``epochs`` × N training samples: defenses that consume more
    samples per round (``local:k`` k·B, ``secagg:L`` L·B) run fewer rounds.
    """

    epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(0.05, gt=0)
    test_fraction: float = Field(0.2, gt=0, lt=1)
    seed: int = Field(0, ge=0, lt=MAX_SEED)
    #: training seeds per setting (default: three, from ``seed``): the utility loss is paired by seed and given
    #: with its interval over them
    seeds: list[int] | None = Field(None, min_length=1, max_length=64)
    per_batch_size: bool = True

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, values: list[int] | None) -> list[int] | None:
        if values is not None:
            bad = [v for v in values if v < 0 or v >= 2**31]
            if bad:
                raise ValueError(f"expected seeds in [0, 2**31), got {bad[0]}")
            if len(set(values)) != len(values):
                raise ValueError("expected distinct seeds, got a repeat")
        return values

    def seed_list(self) -> list[int]:
        """The training seeds: ``seeds``, else three from ``seed``."""
        return list(self.seeds) if self.seeds else [self.seed, self.seed + 1, self.seed + 2]

    def for_seed(self, seed: int) -> dict[str, Any]:
        """The utility options of one training run (what a utility trial's key holds)."""
        out = self.model_dump(exclude={"seeds"})
        out["seed"] = int(seed)
        return out


__all__ = ["DatasetEntry", "ModelEntry", "NormalizeEntry", "ServerEntry", "SERVER_MOVES", "TrainingEntry", "AttackEntry", "DefenseEntry", "UtilityEntry",
           "MAX_SEED", "MAX_THREADS", "MAX_STACK"]
