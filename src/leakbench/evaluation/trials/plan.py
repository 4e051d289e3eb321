"""Expand a :class:`~.spec.SweepSpec` into trials: the cross product, filtered by include/exclude rules.

Order: dataset, model, defense, batch size, seed, batch, attack — so the strongest
attack of a setting is known as soon as its last attack finishes.  Utility
trials (one per dataset × model × defense, when the spec has a ``utility``
section) come first: they are few and the privacy–utility plot needs them all.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any
from collections.abc import Iterable, Mapping

from ...attacks import preset_revision
from ...defenses import family_of
from ...errors import ConfigError
from .origins import stamp
from ..sweep_spec.model import SweepSpec
from .trial import TrialSpec


@lru_cache(maxsize=4096)  # matched once per rule and trial: thousands of calls on a few settings
def defense_family(defense: str) -> tuple[str, str]:
    """``"clip:4+noise:0.01"`` → ``("clip+noise", "4, 0.01")``; ``"none"`` → ``("none", "")`` (the defense grammar's
    :func:`~leakbench.defenses.family_of`)."""
    return family_of(defense)


def _absent(trial: TrialSpec) -> tuple[str, ...]:
    """Rule keys a trial of this kind does not have (utility trials have no attack, batch size or seed)."""
    if "round" not in trial.training:  # only a federated sweep's trials have a round
        return ("round", *_absent_keys(trial))
    return _absent_keys(trial)


def _absent_keys(trial: TrialSpec) -> tuple[str, ...]:
    if trial.kind == "utility" and "federated" in trial.training:
        return ("attack", "batch_size")
    if trial.kind == "utility":
        return ("attack", "seed") if trial.batch_size else ("attack", "batch_size", "seed")
    if (trial.kind == "membership" and trial.membership.get("form") in ("reference", "run")) or (
            trial.kind == "weights" and trial.target.get("run")):
        return ("batch_size",)  # trained with each defense: rules on defenses apply
    return {"bound": ("attack",), "weights": ("batch_size", "defense"),
            "membership": ("batch_size", "defense")}.get(trial.kind, ())


def matches(rule: Mapping[str, Any], trial: TrialSpec, *, absent: bool = False) -> bool:
    """True when ``trial`` matches every key of ``rule`` (a value or a list of accepted values).

    ``dataset``/``model``/``attack`` match the registry name or the label;
    ``defense`` matches the exact spec or its family (``prune`` matches every ``prune:p``); ``round`` a federated
    sweep's attacked round.
    A rule naming a key the trial does not have (``attack`` for a utility trial) gives ``absent``.
    """
    if any(key in _absent(trial) for key in rule):
        return absent
    names = {
        "dataset": {trial.dataset, trial.dataset_key},
        "model": {trial.model, trial.model_key, split_round(trial.model_key)[0]},
        "attack": {trial.attack, trial.attack_key},
        "defense": {trial.defense, defense_family(trial.defense)[0]},
        "batch_size": {trial.batch_size},
        "seed": {trial.seed},
        "round": {trial.training.get("round")},
    }
    for key, wanted in rule.items():
        values = wanted if isinstance(wanted, list) else [wanted]
        if not any(v in names[key] or str(v) in {str(n) for n in names[key]} for v in values):
            return False
    return True


def keep(trial: TrialSpec, include: Iterable[Mapping], exclude: Iterable[Mapping]) -> bool:
    """Kept when some include rule matches (or there are none) and no exclude rule does.

    Rules naming keys a trial does not have never exclude it and always include it, so
    ``exclude: [{attack: dlg}]`` keeps every utility trial.
    """
    include = list(include)
    if include and not any(matches(r, trial, absent=True) for r in include):
        return False
    return not any(matches(r, trial, absent=False) for r in exclude)


def plan(spec: SweepSpec) -> list[TrialSpec]:
    """The trials of ``spec`` in run order (utility trials first), without duplicates."""
    trials: dict[str, TrialSpec] = {}
    defenses = spec.defense_specs()
    common = dict(device=spec.device, threads=spec.threads, stack=spec.stack,
                  trial_seconds=spec.budget.trial_seconds, save_images=spec.save_images)
    for d in spec.datasets:
        for i, m in enumerate(spec.models):
            if m.federated is not None:
                for t in _federated(spec, d, m, defenses, common):
                    if keep(t, spec.include, spec.exclude):
                        _check_public(t, m, i)
                        trials.setdefault(t.key, t)
                continue
            base = dict(dataset=d.name, data_options=dict(d.options), dataset_key=d.key, model=m.spec,
                        model_key=m.key, training=m.training.model_dump(),
                        model_options=m.build_options(),
                        server=_server(m))
            if spec.utility is not None:
                # the server's move does not change what a defense costs: same training, cached by utility()
                sizes = spec.batch_sizes if spec.utility.per_batch_size else [0]
                for defense in defenses:
                    for size in sizes:
                        for seed in spec.utility.seed_list():
                            t = TrialSpec(kind="utility", defense=defense, batch_size=size,
                                          utility=spec.utility.for_seed(seed), **base, **common)
                            if keep(t, spec.include, spec.exclude):
                                trials.setdefault(t.key, t)
            for defense in defenses:
                for size in spec.batch_sizes:
                    for seed in spec.seeds:
                        for batch in range(max(1, spec.images // size)):
                            for a in spec.attacks:
                                t = TrialSpec(kind="attack", defense=defense, batch_size=size, images=spec.images,
                                              batch=batch, seed=seed, attack=a.name, attack_key=a.key,
                                              preset=a.preset, preset_revision=preset_revision(a.name, a.preset),
                                              options=dict(a.options),
                                              threat={**spec.threat.model_dump(), **a.threat}, **base, **common)
                                if keep(t, spec.include, spec.exclude):
                                    trials.setdefault(t.key, t)
                            if spec.bounds is not None and spec.bounds.cramer_rao and not m.server:
                                t = TrialSpec(kind="bound", defense=defense, batch_size=size, images=spec.images,
                                              batch=batch, seed=seed, threat=spec.threat.model_dump(),
                                              bounds=spec.bounds.model_dump(), **base, **common)
                                if keep(t, spec.include, spec.exclude):
                                    trials.setdefault(t.key, t)
    for section, kind in (("weights", "weights"), ("membership", "membership")):
        for entry in getattr(spec, section):
            if kind == "membership" and entry.reference:
                made = _reference(entry, spec, common)
            elif entry.run is not None:
                made = _run_trials(entry, kind, spec, common)
            else:
                made = _published(entry, kind, common)
            for t in made:
                if keep(t, spec.include, spec.exclude):
                    trials.setdefault(t.key, t)
    ordered = sorted(trials.values(), key=lambda t: t.kind != "utility")  # stable: utility first
    return [stamp(t) for t in ordered]  # each with the digests of the plug-ins it uses (part of its key)


#: how a federated sweep names a model at a round (:func:`round_key`)
ROUND_SEPARATOR = " · round "


def round_key(model_key: str, round_: int) -> str:
    """How tables name a model at a federated round: ``"cnn:3-8 · round 5"``."""
    return f"{model_key}{ROUND_SEPARATOR}{round_}"


def split_round(model: str) -> tuple[str, int | None]:
    """``"cnn · round 5"`` → ``("cnn", 5)``; a model key without a round → ``(model, None)``."""
    base, sep, tail = model.rpartition(ROUND_SEPARATOR)
    if sep and tail.isdigit():
        return base, int(tail)
    return model, None


def _federated(spec: SweepSpec, d, m, defenses: list[str], common: dict) -> list[TrialSpec]:
    """The trials of one (dataset, model) of a federated sweep, round by round: the run's utility at each attacked
    round (one trial per seed), each attack on the clients' batches, and each attack on the public client's (the
    attack's power at that checkpoint, :mod:`.strongest`)."""
    fed = m.federated
    out = []
    for r in fed.rounds:
        base = dict(dataset=d.name, data_options=dict(d.options), dataset_key=d.key, model=m.spec,
                    model_key=round_key(m.key, r), model_options=m.build_options(), server=_server(m))
        for defense in defenses:
            for seed in spec.seeds:
                # the run's attacked rounds: divergence is judged at its last (kinds.federated_utility)
                training = {"federated": fed.run_options(), "round": r, "seed": seed, "rounds": list(fed.rounds)}
                out.append(TrialSpec(kind="utility", defense=defense, seed=seed, training=training,
                                     utility={"seed": seed}, threat={"loss": spec.threat.loss}, **base, **common))
            for size in spec.batch_sizes:
                for seed in spec.seeds:
                    training = {"federated": fed.run_options(), "round": r, "seed": seed}
                    for batch in range(max(1, spec.images // size)):
                        for client in ("", "public") if fed.public else ("",):
                            for a in spec.attacks:
                                out.append(TrialSpec(
                                    kind="attack", defense=defense, batch_size=size, images=spec.images, batch=batch,
                                    seed=seed, attack=a.name, attack_key=a.key, preset=a.preset,
                                    preset_revision=preset_revision(a.name, a.preset), options=dict(a.options),
                                    threat={**spec.threat.model_dump(), **a.threat}, training=training, client=client,
                                    **base, **common))
    return out


def _check_public(trial: TrialSpec, model, index: int) -> None:
    """A federated model's public client must hold a whole batch of every size attacked on it (after the rules)."""
    public = model.federated.public
    if trial.kind == "attack" and public and trial.batch_size > public:
        raise ConfigError(f"spec field models[{index}].federated.public: expected at least every batch size attacked "
                          f"on model {model.key!r} so the public client holds a batch, got {public} < B = "
                          f"{trial.batch_size}; raise its federated.public or exclude batch_size "
                          f"{trial.batch_size} for this model")


def _server(model) -> dict[str, Any]:
    if model.server is None:
        return {}
    name, options = model.server.move
    return {"move": name, "options": options, "public": model.server.public}


def _published(entry, kind: str, common: dict) -> list[TrialSpec]:
    """The trials of one ``weights`` or ``membership`` entry: attacks × seeds (× margin settings)."""
    t = entry.target
    target = {"dataset": {"name": t.dataset.name, "options": dict(t.dataset.options)}, "classes": t.classes,
              "per_class": t.per_class, "nonmembers": t.nonmembers, "options": dict(t.options)}
    base = dict(kind=kind, dataset=t.dataset.name, data_options=dict(t.dataset.options), dataset_key=t.dataset.key,
                model=str(t.options.get("model", "mlp:1000-1000")), model_key=t.key, target=target, **common)
    settings = entry.settings if kind == "membership" else [None]
    out = []
    attacks = entry.attack_list if kind == "membership" else entry.attacks
    for seed in entry.seeds:
        for a in attacks:
            for setting in settings:
                extra = {}
                if setting is not None:
                    extra["membership"] = {"setting": setting, "leaked_size": entry.leaked_size,
                                           "bound_width": entry.bound_width}
                out.append(TrialSpec(seed=seed, attack=a.name, attack_key=a.key + (f" ({setting} margin)" if setting
                                                                                   else ""),
                                     preset=a.preset, preset_revision=preset_revision(a.name, a.preset),
                                     options=dict(a.options), **extra, **base))
    return out


def _reference(entry, spec: SweepSpec, common: dict) -> list[TrialSpec]:
    """The trials of a reference-model ``membership`` entry: seeds × attacks × defenses.

    Attack-major (every defense of one attack before the next attack): two workers then train different
    defenses' reference models at once, and the later attacks of a setting find them cached."""
    d, m = entry.dataset, entry.model
    recipe = entry.recipe(spec.utility).model_dump()
    setup = {"form": "reference", "pool": entry.pool, "reference_models": entry.reference_models,
             "recipe": recipe, **({"canaries": entry.canaries} if entry.canaries else {})}
    base = dict(kind="membership", dataset=d.name, data_options=dict(d.options), dataset_key=d.key, model=m.spec,
                model_key=m.key, model_options=m.build_options(), membership=setup, **common)
    out = []
    for seed in entry.seeds:
        for a in entry.attack_list:
            for defense in entry.defense_specs(spec.defense_specs()):
                out.append(TrialSpec(seed=seed, defense=defense, attack=a.name, attack_key=a.key,
                                     options=dict(a.options), **base))
    return out


def _run_trials(entry, kind: str, spec: SweepSpec, common: dict) -> list[TrialSpec]:
    """The trials of a ``weights`` or ``membership`` entry on a federated run (``run``): dataset × round × attack ×
    defense × seed, each on the checkpoint the reconstruction trials of that round attack (the same run: same
    key, same cache)."""
    m = spec.run_model(entry.run)
    fed = m.federated
    if kind == "membership":
        extra: dict[str, Any] = {"membership": {"form": "run", "pool": entry.pool, "client": entry.client}}
        attacks = entry.attack_list
    else:
        extra = {"target": {"run": entry.run, "members": entry.members, "client": entry.client}}
        attacks = entry.attacks
    out = []
    for d in spec.datasets:
        for r in entry.rounds or fed.rounds:
            base = dict(kind=kind, dataset=d.name, data_options=dict(d.options), dataset_key=d.key,
                        model=m.spec, model_key=round_key(m.key, r), model_options=m.build_options(),
                        threat={"loss": spec.threat.loss}, **extra, **common)
            for a in attacks:
                for defense in spec.defense_specs():
                    for seed in spec.seeds:
                        training = {"federated": fed.run_options(), "round": r, "seed": seed}
                        out.append(TrialSpec(seed=seed, defense=defense, attack=a.name, attack_key=a.key,
                                             preset=a.preset, preset_revision=preset_revision(a.name, a.preset),
                                             options=dict(a.options), training=training, **base))
    return out


__all__ = ["plan", "matches", "keep", "defense_family", "round_key", "split_round", "ROUND_SEPARATOR"]
