"""The entries of a sweep spec's published-weights side: the trained targets, the ``weights:`` attacks on them
and ``membership:`` inference with reference models, each bounded (pool size, reference models)."""
from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from .entries import AttackEntry, DatasetEntry, DefenseEntry, ModelEntry, UtilityEntry, _Strict


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
    """Published weights: train ``target`` once, run each attack on its weights (kkt, model-inversion, univariate).

    Or the rounds of a federated run (``run``: the label of a ``models:`` entry with a ``federated:`` section):
    each attack runs on the run's global model at each of ``rounds`` (default: that entry's rounds) under each of
    the sweep's defenses and seeds, its candidates scored against at most ``members`` of the clients' samples
    (every client's, or client ``client``'s) beside as many of the run's test split (the control).
    """

    target: TargetEntry | None = None
    attacks: list[AttackEntry] = Field(min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    run: str | None = Field(None, min_length=1, max_length=200)
    rounds: list[int] | None = Field(None, min_length=1, max_length=1000)
    client: int | None = Field(None, ge=0, le=10_000)
    members: int = Field(100, ge=1, le=10_000)

    @model_validator(mode="after")
    def _one_form(self) -> WeightsEntry:
        if (self.target is None) == (self.run is None):
            raise ValueError("expected either target: (a model the library trains and publishes) or run: (the label "
                             "of a federated model entry, its rounds' global models attacked), "
                             + ("got both" if self.target is not None else "got neither"))
        if self.run is None and (self.rounds is not None or self.client is not None):
            raise ValueError("rounds: and client: belong to the run: form; remove them or name the run")
        if self.run is not None and "seeds" in self.model_fields_set:
            raise ValueError("the run: form attacks the sweep's own runs (one per seed of the sweep), so seeds does "
                             "not apply; remove it")
        return self


#: what the membership attacker knows of the margin (provable-attacks paper, Cor. 4.3–4.5).
MEMBERSHIP_SETTINGS = ("known", "leaked", "bounded")


#: the reference-model attacks a ``membership`` entry with a ``model`` runs when it names none (labels in tables).
REFERENCE_ATTACKS = ({"name": "membership-loss", "label": "loss"},
                     {"name": "membership-lira", "options": {"online": True}, "label": "lira-online"},
                     {"name": "membership-lira", "options": {"online": False}, "label": "lira-offline"},
                     {"name": "membership-rmia", "label": "rmia"})
#: the attacks a ``membership`` entry with a ``run`` runs when it names none: those that need no reference models
RUN_ATTACKS = ({"name": "membership-loss", "label": "loss"},)
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
    (:mod:`leakbench.evaluation.membership.reference`) give LiRA and RMIA their IN/OUT statistics.  ``attacks`` (default:
    loss, LiRA online and offline, RMIA) are the membership attacks; ``membership-margin`` applies to
    one-output binary models only (``n/a`` otherwise).  ``canaries``: for DP-SGD settings, the one-run audit
    (:func:`~leakbench.evaluation.membership.audit.one_run_audit`) on one more training run holding that many canaries.

    **The rounds of a federated run** (``run``): the label of a ``models:`` entry with a ``federated:`` section;
    its global model at each of ``rounds`` (default: that entry's rounds) is attacked — the same checkpoints the
    reconstruction attacks of those rounds see, under each of the sweep's defenses and seeds.  Members: at most
    ``pool``/2 of the clients' samples (every client's, or client ``client``'s); non-members: as many of the
    run's test split (:mod:`leakbench.evaluation.membership.round_trial`).  ``attacks`` default to
    :data:`RUN_ATTACKS`, the ones that need no reference models.
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
    run: str | None = Field(None, min_length=1, max_length=200)
    rounds: list[int] | None = Field(None, min_length=1, max_length=1000)
    client: int | None = Field(None, ge=0, le=10_000)

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
        forms = [name for name, given in (("target:", self.target is not None),
                                          ("model:/dataset:", self.model is not None or self.dataset is not None),
                                          ("run:", self.run is not None)) if given]
        if len(forms) > 1:
            raise ValueError(f"expected one form of membership entry — target: (the margin attack on a trained "
                             f"two-layer net), model: and dataset: (reference-model attacks) or run: (the rounds of "
                             f"a federated run) — got {' and '.join(forms)}")
        if not forms or (self.run is None and self.target is None and (self.model is None or self.dataset is None)):
            raise ValueError("expected target: (the margin attack on a trained two-layer net), both model: and "
                             "dataset: (reference-model attacks: loss, LiRA, RMIA), e.g. "
                             "{dataset: digits, model: 'mlp:64', reference_models: 4}, or run: (the label of a "
                             "federated model entry, its rounds attacked)")
        if self.run is None and (self.rounds is not None or self.client is not None):
            raise ValueError("rounds: and client: belong to the run: form (membership on a federated run's rounds); "
                             "remove them or name the run")
        if self.run is not None:
            extra = sorted(set(self.model_fields_set) & {"seeds", "defenses", "reference_models", "training",
                                                         "canaries"})
            if extra:
                raise ValueError(f"the run: form attacks the sweep's own runs (one per seed and defense of the sweep, "
                                 f"trained by its federated: section), so {', '.join(extra)} do(es) not apply; "
                                 "remove it")
            if self.rounds is not None and any(r < 0 for r in self.rounds):
                raise ValueError(f"expected rounds ≥ 0 (0 = the start), got {min(self.rounds)}")
        return self

    @property
    def reference(self) -> bool:
        """The reference-model form (``model`` and ``dataset``), not the margin form (``target``) nor a run's."""
        return self.target is None and self.run is None

    @property
    def attack_list(self) -> list[AttackEntry]:
        """``attacks``, or the form's default: the margin attack, or :data:`REFERENCE_ATTACKS`."""
        if self.attacks is not None:
            return list(self.attacks)
        if self.run is not None:
            return [AttackEntry.model_validate(a) for a in RUN_ATTACKS]
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


__all__ = ["RecipeEntry", "REFERENCE_ATTACKS", "RUN_ATTACKS", "MAX_POOL", "MAX_REFERENCE_MODELS", "TargetEntry", "WeightsEntry", "MembershipEntry", "MEMBERSHIP_SETTINGS"]
