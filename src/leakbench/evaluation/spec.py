"""The sweep spec: a YAML file validated by pydantic, with errors that name the line.

A sweep is the cross product datasets × models × batch sizes × defenses ×
attacks × seeds (× batches of the ``images`` attacked per setting), filtered by
``include``/``exclude`` rules.  Names resolve through the registries, so a newly
registered attack or defense is usable in a spec without touching this file::

    name: tiny
    datasets: [{name: digits}]
    models: ["cnn:3-8-2-1"]
    batch_sizes: [1, 4]
    images: 4                       # images attacked per setting and seed
    attacks:
      - dlg                         # a name, or a mapping with preset / options / label
      - {name: inverting-gradients, preset: quick}
    defenses:
      - none
      - {prune: [0.5, 0.9]}         # one family, a grid of parameters
      - {spec: "clip:{C}+noise:{s}", grid: {C: [2, 4], s: [0.01]}}
    seeds: [0]
    exclude: [{attack: dlg, batch_size: 4}]

:func:`load_spec` reads a path, YAML text or a mapping (:mod:`.specsource`: YAML with line numbers),
checks every name through the registries (:mod:`.specnames`) and raises one
:class:`~leakbench.errors.ConfigError` reading
``"spec.yaml line 7, field attacks[1].name: unknown attack 'dgl'. Did you mean 'dlg'? Known attacks: ..."``.
"""
from __future__ import annotations

import itertools
import string
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import ConfigError
from ..plugins import load as load_plugins
from .specfederated import FederatedEntry
from .specnames import check_names
from .specsource import Source as _Source
from .specsource import pydantic_message, read_spec

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
                "fishing": "leakbench.models.active.fishing"}
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
    is Wen et al.'s class fishing (:func:`~leakbench.models.active.fishing`).  ``public``: images the
    server holds (drawn from the dataset, never one of the attacked images) to place the imprint bins at
    equal-mass quantiles, calibrate the trap rows or centre the random head (``center: calibration``).
    """

    imprint: dict[str, Any] | None = None
    random_head: dict[str, Any] | None = None
    trap_weights: dict[str, Any] | None = None
    fishing: dict[str, Any] | None = None
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
        from ..models import MODELS
        from ..models.custom import class_digest, is_class_spec

        if is_class_spec(self.spec, MODELS.names()):  # an edited class is a new trial
            options["source_digest"] = class_digest(self.spec, field="spec")
        if self.file:
            from ..models.files import file_digest

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


class TargetEntry(_Strict):
    """A published model: the dataset it is trained on and :func:`~leakbench.models.targets.train_target`'s options.

    ``classes`` keeps two (or more) classes of the dataset, relabelled 0..k−1 in the order given
    (names or indices): the binary targets of Haim et al. and of the margin attack need two.
    ``per_class`` training samples of each kept class are the members; ``nonmembers`` held-out
    samples of the same classes (default: as many as members) are the control.
    """

    dataset: DatasetEntry
    classes: list[Any] | None = None
    per_class: int = Field(10, ge=1)
    nonmembers: int | None = Field(None, ge=1)
    options: dict[str, Any] = Field(default_factory=dict)
    label: str | None = None

    @property
    def key(self) -> str:
        if self.label:
            return self.label
        kept = f"[{','.join(map(str, self.classes))}]" if self.classes else ""
        model = self.options.get("model", "mlp:1000-1000")
        return f"{model} on {self.dataset.key}{kept} ×{self.per_class}/class"


class WeightsEntry(_Strict):
    """Published weights: train ``target`` once, run each attack on its weights (kkt, model-inversion, univariate)."""

    target: TargetEntry
    attacks: list[AttackEntry] = Field(min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)


#: what the membership attacker knows of the margin (provable-attacks paper, Cor. 4.3–4.5).
MEMBERSHIP_SETTINGS = ("known", "leaked", "bounded")


#: the reference-model attacks a ``membership`` entry with a ``model`` runs when it names none (labels in tables).
REFERENCE_ATTACKS = ({"name": "membership-loss", "label": "loss"},
                     {"name": "membership-lira", "options": {"online": True}, "label": "lira-online"},
                     {"name": "membership-lira", "options": {"online": False}, "label": "lira-offline"},
                     {"name": "membership-rmia", "label": "rmia"})
#: the largest population pool and reference-model count an entry may ask for (each model trains on half the pool).
MAX_POOL = 100_000
MAX_REFERENCE_MODELS = 256


class RecipeEntry(_Strict):
    """How the membership target (and every reference model) is trained: the utility section's fields."""

    epochs: int = Field(5, ge=1, le=10_000)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(0.05, gt=0)
    loss: str = "ce"


class MembershipEntry(_Strict):
    """Membership inference, in one of two forms.

    **Margin** (``target``): the margin attack of the provable-attacks paper against a trained two-layer
    ``target``, each attack in each margin-knowledge setting.  ``leaked`` gives the attacker a set of
    ``leaked_size`` queried points holding one member; ``bounded`` gives γ ∈ [γ·(1 − ``bound_width``),
    γ·(1 + ``bound_width``)].

    **Reference models** (``model`` and ``dataset``): a target built from ``model`` is trained with ``training``
    (default: the sweep's ``utility`` epochs, batch size and learning rate) and each defense of ``defenses``
    (default: the sweep's ``defenses``) on a seeded half of a ``pool`` of points drawn from ``dataset``; the
    other half are its non-members.  ``reference_models`` models trained the same way on halves of the pool
    (:mod:`leakbench.evaluation.reference`) give LiRA and RMIA their IN/OUT statistics.  ``attacks`` (default:
    loss, LiRA online and offline, RMIA) are the membership attacks; ``membership-margin`` applies to
    one-output binary models only (``n/a`` otherwise).  ``canaries``: for DP-SGD settings, the one-run audit
    (:func:`~leakbench.evaluation.audit.one_run_audit`) on one more training run holding that many canaries.
    """

    target: TargetEntry | None = None
    dataset: DatasetEntry | None = None
    model: ModelEntry | None = None
    training: RecipeEntry | None = None
    pool: int = Field(2000, ge=4, le=MAX_POOL)
    reference_models: int = Field(4, ge=1, le=MAX_REFERENCE_MODELS)
    #: DP-SGD settings only: one more training run with this many random-label canaries, each included by a fair
    #: coin, audited in one run (Steinke, Nasr & Jagielski 2023); 0: none
    canaries: int = Field(0, ge=0, le=10_000)
    defenses: list[DefenseEntry] | None = Field(None, min_length=1)
    attacks: list[AttackEntry] | None = Field(None, min_length=1)
    settings: list[str] = Field(default_factory=lambda: list(MEMBERSHIP_SETTINGS), min_length=1)
    leaked_size: int = Field(10, ge=1)
    bound_width: float = Field(0.2, ge=0, lt=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)

    @field_validator("settings")
    @classmethod
    def _settings(cls, values: list[str]) -> list[str]:
        bad = [v for v in values if v not in MEMBERSHIP_SETTINGS]
        if bad:
            raise ValueError(f"expected settings among {', '.join(MEMBERSHIP_SETTINGS)}, got {bad[0]!r}")
        return values

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if v < 0 or v >= 2**31]
        if bad:
            raise ValueError(f"expected seeds in [0, 2**31), got {bad[0]}")
        return values

    @model_validator(mode="after")
    def _one_form(self) -> MembershipEntry:
        if self.target is not None and (self.model is not None or self.dataset is not None):
            raise ValueError("expected either target: (the margin attack on a trained two-layer net) or model: and "
                             "dataset: (reference-model attacks), got both")
        if self.target is None and (self.model is None or self.dataset is None):
            raise ValueError("expected target: (the margin attack on a trained two-layer net) or both model: and "
                             "dataset: (reference-model attacks: loss, LiRA, RMIA), e.g. "
                             "{dataset: digits, model: 'mlp:64', reference_models: 4}")
        return self

    @property
    def reference(self) -> bool:
        """The reference-model form (``model`` and ``dataset``), not the margin form (``target``)."""
        return self.target is None

    @property
    def attack_list(self) -> list[AttackEntry]:
        """``attacks``, or the form's default: the margin attack, or :data:`REFERENCE_ATTACKS`."""
        if self.attacks is not None:
            return list(self.attacks)
        if self.reference:
            return [AttackEntry.model_validate(a) for a in REFERENCE_ATTACKS]
        return [AttackEntry(name="membership-margin")]

    def recipe(self, utility: UtilityEntry | None) -> RecipeEntry:
        """The training recipe: ``training``, else the sweep's utility section's, else the defaults."""
        if self.training is not None:
            return self.training
        if utility is not None:
            return RecipeEntry(epochs=utility.epochs, batch_size=utility.batch_size, lr=utility.lr)
        return RecipeEntry()

    def defense_specs(self, sweep_defenses: list[str]) -> list[str]:
        """Every defense setting of this entry (``defenses``, else the sweep's), in order, without repeats."""
        if self.defenses is None:
            return list(sweep_defenses)
        seen: dict[str, None] = {}
        for entry in self.defenses:
            for spec in entry.expand():
                seen.setdefault(spec, None)
        return list(seen)


class ThreatEntry(_Strict):
    """What the client shares and what the attacker is granted (arguments of :func:`leakbench.observe`)."""

    loss: str = "ce"
    labels_known: bool = False
    local_steps: int = Field(0, ge=0)
    local_lr: float = Field(0.1, gt=0)
    train: bool = False
    bn_stats: bool = False


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


class BoundsEntry(_Strict):
    """Cramér–Rao bounds on the error of unbiased estimators, drawn on the privacy–utility plot (biased attacks can beat them)."""

    cramer_rao: bool = True
    options: dict[str, Any] = Field(default_factory=dict)


class ReplicateEntry(_Strict):
    """Adaptive replication: after the planned trials, add ``step`` batches at a time to the cells whose verdict
    is still undecided (a tie that is not exact, or fewer than MIN_N batches), until each is decided,
    ``max_batches`` per cell is reached, or ``max_trials`` added trials / ``max_minutes`` of replication rounds
    (counted from the end of the planned trials) are spent."""

    auto: bool = False
    step: int = Field(4, ge=1, le=256)
    max_batches: int = Field(48, ge=1, le=4096)
    max_trials: int = Field(2000, ge=1, le=1_000_000)
    max_minutes: float | None = Field(None, gt=0)


class BudgetEntry(_Strict):
    """Time limits: per trial (stopped at the attack's next progress report) and per sweep run."""

    trial_seconds: float | None = Field(None, gt=0)
    sweep_minutes: float | None = Field(None, gt=0)


class SweepSpec(_Strict):
    """A validated sweep (see the module docstring for the YAML form)."""

    name: str = "sweep"
    description: str = ""
    #: modules imported before any name is resolved, whose ``register`` decorators add attacks, defenses, metrics,
    #: datasets and models (:mod:`leakbench.plugins`; module names, from installed packages or PYTHONPATH)
    plugins: list[str] = Field(default_factory=list)
    datasets: list[DatasetEntry] = Field(min_length=1)
    models: list[ModelEntry] = Field(min_length=1)
    batch_sizes: list[int] = Field(min_length=1)
    images: int = Field(1, ge=1)
    attacks: list[AttackEntry] = Field(default_factory=list)
    defenses: list[DefenseEntry] = Field(default_factory=lambda: [DefenseEntry(spec="none")], min_length=1)
    weights: list[WeightsEntry] = Field(default_factory=list)
    membership: list[MembershipEntry] = Field(default_factory=list)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    threat: ThreatEntry = Field(default_factory=ThreatEntry)
    utility: UtilityEntry | None = None
    bounds: BoundsEntry | None = None
    budget: BudgetEntry = Field(default_factory=BudgetEntry)
    replicate: ReplicateEntry = Field(default_factory=ReplicateEntry)
    include: list[dict[str, Any]] = Field(default_factory=list)
    exclude: list[dict[str, Any]] = Field(default_factory=list)
    device: str = "cpu"
    threads: int = Field(1, ge=1, le=MAX_THREADS)
    #: the most trials of one shape solved as one batched call (None: measured per device, see
    #: ``evaluation.chunks``; 1: every trial alone, as before batching)
    stack: int | None = Field(None, ge=1, le=MAX_STACK)
    save_images: bool = True
    max_trials: int | None = Field(None, ge=1)  # the largest sweep this spec may plan (default MAX_TRIALS)

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if v < 1]
        if bad:
            raise ValueError(f"expected batch sizes ≥ 1, got {bad[0]}")
        return values

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if v < 0 or v >= MAX_SEED]
        if bad:
            raise ValueError(f"expected seeds in 0..2**63-1 (non-negative, stored as 64-bit integers), got {bad[0]}")
        return values

    @model_validator(mode="after")
    def _some_work(self) -> SweepSpec:
        if not (self.attacks or self.weights or self.membership):
            raise ValueError("expected at least one of attacks, weights or membership; add attacks: [dlg] "
                             "(gradient attacks), a weights: entry or a membership: entry")
        for m in self.models:
            if m.federated is not None and m.federated.public:
                big = [size for size in self.batch_sizes if size > m.federated.public]
                if big:
                    raise ValueError(f"expected batch sizes ≤ federated.public ({m.federated.public}) of model "
                                     f"{m.key!r} so the public client holds a batch, got {big[0]}; raise its "
                                     "federated.public")
        return self

    def defense_specs(self) -> list[str]:
        """Every concrete defense setting, in spec order, without repeats."""
        seen: dict[str, None] = {}
        for entry in self.defenses:
            for spec in entry.expand():
                seen.setdefault(spec, None)
        return list(seen)


def load_spec(source: str | Path | Mapping | SweepSpec, *, check: bool = True) -> SweepSpec:
    """Read and validate a sweep spec (a path, YAML text or a mapping).

    With ``check`` (default), every name is resolved through the registries
    (datasets, models, attacks with presets and options, defenses, losses,
    devices) so a bad spec fails here, before any trial runs.
    """
    if isinstance(source, SweepSpec):
        load_plugins(source.plugins, source="spec")
        if check:
            check_names(source, _Source("spec", {}))
        return source
    try:
        data, where = read_spec(source)
    except RecursionError:
        raise ConfigError("spec: nested too deeply to read (RecursionError); a sweep spec is a few levels of "
                          "mappings and lists — flatten it") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where.name}: expected a mapping with datasets, models, batch_sizes, attacks..., "
                          f"got {type(data).__name__}")
    try:
        spec = SweepSpec.model_validate(data)
    except RecursionError:
        raise ConfigError(f"{where.name}: nested too deeply to validate (RecursionError); flatten it") from None
    except ValidationError as err:
        problems = [pydantic_message(e, SweepSpec) for e in err.errors()]
        path, msg = problems[0]
        more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        raise ConfigError(f"{where.where(path)}: {msg}{more}") from None
    for i, name in enumerate(spec.plugins):  # before any name is resolved
        try:
            load_plugins([name], source="spec")
        except ConfigError as err:
            raise ConfigError(f"{where.where(('plugins', i))}: {err}") from None
    if check:
        check_names(spec, where)
    return spec


def dump_spec(spec: SweepSpec) -> str:
    """The spec as YAML text (stored with the results so a sweep is reproducible from its store)."""
    return yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=False), sort_keys=False)


__all__ = ["SweepSpec", "DatasetEntry", "ModelEntry", "RecipeEntry", "REFERENCE_ATTACKS", "MAX_POOL",
           "MAX_REFERENCE_MODELS", "NormalizeEntry", "ServerEntry", "TargetEntry", "WeightsEntry",
           "MembershipEntry", "MEMBERSHIP_SETTINGS", "SERVER_MOVES", "TrainingEntry", "AttackEntry", "DefenseEntry",
           "ThreatEntry", "UtilityEntry", "BoundsEntry", "BudgetEntry", "ReplicateEntry", "load_spec", "dump_spec",
           "MAX_SEED", "MAX_THREADS", "MAX_STACK", "FederatedEntry"]
