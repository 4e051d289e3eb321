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

:func:`load_spec` reads a path, YAML text or a mapping (:mod:`.source`: YAML with line numbers),
checks every name through the registries (:mod:`.names`) and raises one
:class:`~leakbench.errors.ConfigError` reading
``"spec.yaml line 7, field attacks[1].name: unknown attack 'dgl'. Did you mean 'dlg'? Known attacks: ..."``.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from ...errors import ConfigError
from ...plugins import load as load_plugins
from .entries import (MAX_SEED, MAX_STACK, MAX_THREADS, AttackEntry, DatasetEntry, DefenseEntry, ModelEntry,
    UtilityEntry, _Strict)
from .names import MAX_LISTED, check_names
from .source import Source as _Source
from .source import pydantic_message, read_spec
from .weights import MembershipEntry, WeightsEntry


class ThreatEntry(_Strict):
    """What the client shares and what the attacker is granted (arguments of :func:`leakbench.observe`)."""

    loss: str = "ce"
    labels_known: bool = False
    local_steps: int = Field(0, ge=0)
    local_lr: float = Field(0.1, gt=0)
    train: bool = False
    bn_stats: bool = False


class BoundsEntry(_Strict):
    """Cramér–Rao bounds on the error of unbiased estimators, drawn on the privacy–utility plot (biased attacks can beat them)."""

    cramer_rao: bool = True
    options: dict[str, Any] = Field(default_factory=dict)


class ReplicateEntry(_Strict):
    """Adaptive replication: after the planned trials, add ``step`` batches at a time to the cells whose verdict
    is still undecided (a tie that is not exact, or fewer than MIN_N batches), until each is decided,
    ``max_batches`` per cell is reached, or ``max_trials`` added trials / ``max_minutes`` of replication rounds
    (counted from the end of the planned trials) are spent.  No added trial starts after ``max_minutes`` (one
    already started finishes; the others stay pending, and a resumed sweep runs them first); under it a round
    runs whole cells, the cheapest first."""

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
        return self  # a federated model's public client must hold every batch attacked on it: checked by the plan

    def defense_specs(self) -> list[str]:
        """Every concrete defense setting, in spec order, without repeats."""
        seen: dict[str, None] = {}
        for entry in self.defenses:
            for spec in entry.expand():
                seen.setdefault(spec, None)
        return list(seen)

    def run_model(self, name: str) -> ModelEntry | None:
        """The ``models:`` entry with a ``federated:`` section that ``name`` names (its label, key or spec; a
        membership entry's ``run``), or None."""
        return next((m for m in self.models if m.federated is not None and name in (m.key, m.label, m.spec)), None)


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
        problems = [f"{where.where(path)}: {msg}" for path, msg in (pydantic_message(e, SweepSpec)
                                                                     for e in err.errors())]
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:MAX_LISTED + 1])}" if len(problems) > 1 else ""
        if len(problems) > MAX_LISTED + 1:
            more += f"; {len(problems) - MAX_LISTED - 1} more not listed"
        raise ConfigError(problems[0] + (more + ")" if more else "")) from None
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


__all__ = ["SweepSpec", "ThreatEntry", "BoundsEntry", "BudgetEntry", "ReplicateEntry", "load_spec", "dump_spec"]
