"""Check everything a sweep's trials need before the first one runs (what ``evaluate --dry-run`` reports).

:func:`load_spec` resolves names; :func:`preflight` goes further, so a sweep never says "valid" and
then fails every trial at run time:

- the sweep's size: :func:`count_trials` counts the planned trials without building one
  ``TrialSpec`` per batch, and :func:`check_size` refuses more than :data:`~.spec.MAX_TRIALS`
  unless the spec's ``max_trials`` (or ``leakbench evaluate --yes``) allows them;
- every dataset is loaded once (bad option values such as ``size: big``, a missing npz or folder,
  NaN pixels, too few samples for the batch sizes and ``images``);
- every model is built once on every dataset's shape with its ``act``, ``init`` and options
  (``act: relux``, ``cnn:99-1-1-0`` on 8×8 images) and one client round is observed on the
  smallest batch under the spec's threat settings (a ±1 loss on a 10-class dataset);
- every training run passes the check it makes at run time (:func:`~.utility.check_training`: epochs, a
  batch size that fits its training set — ⌊pool/2⌋ for a membership target and its reference models — and a
  finite positive lr), a membership entry's ``canaries`` make at least one guess (:func:`~.audit.check_canaries`),
  and every float field of the spec is finite (``lr: .inf`` is refused when the spec is read);
- the plan is not empty;
- the work a user value sizes (:func:`check_work`): an attack's iterations × restarts × ... (bounded at run
  time by ``budget.trial_seconds`` when it is set, else refused past :data:`MAX_ATTACK_WORK`), any single
  loop option past :data:`MAX_LOOP`, and training (model ``training.epochs``, ``utility.epochs``, a
  published target's ``steps``) past :data:`MAX_TRAIN_SAMPLES` samples, refused here with the estimate; below
  it, ``budget.sweep_minutes`` (every trial) and ``budget.trial_seconds`` (a utility trial) stop training at
  run time (:mod:`leakbench.budget`).

Errors are :class:`~leakbench.errors.ConfigError` lines naming the spec field
(``datasets[0].options``, ``models[1] on datasets[0]``, ``threat``...).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import ConfigError, LeakbenchError
from ...models.files import load_weights
from ..sweep_spec.modality import pair_refusal
from ..sweep_spec.model import SweepSpec
from ..sweep_spec.check import MAX_TRIALS


@dataclass
class Preflight:
    """What :func:`preflight` checked: trials per kind, the datasets' shapes, the models built, its time."""

    trials: int
    kinds: dict[str, int] = field(default_factory=dict)
    datasets: dict[str, tuple[tuple[int, ...], int, int]] = field(default_factory=dict)  # key → (shape, n, classes)
    models: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in self.kinds.items() if n)
        data = "; ".join(f"{k}: {v[1]} × {'×'.join(map(str, v[0]))}, {v[2]} classes"
                         for k, v in self.datasets.items())
        return (f"{self.trials} trial(s) ({kinds}); checked {len(self.datasets)} dataset(s) ({data}) and "
                f"{self.models} model build(s) in {self.seconds:.1f} s")


def _upper_bound(spec: SweepSpec) -> int:
    """Trials of the full cross product before include/exclude rules (an upper bound, O(1))."""
    settings = len(spec.datasets) * len(spec.models) * len(spec.defense_specs())
    batches = sum(max(1, spec.images // b) for b in spec.batch_sizes) * len(spec.seeds)
    per_batch = len(spec.attacks) + (1 if spec.bounds is not None and spec.bounds.cramer_rao else 0)
    published = sum(len(e.attacks) * len(e.seeds) for e in spec.weights)
    published += sum(len(e.attack_list) * len(e.seeds) * (len(e.defense_specs(spec.defense_specs())) if e.reference
                                                           else len(e.settings))
                     for e in spec.membership if e.run is None)
    # a run's rounds: every dataset, round, defense and seed of the sweep (rounds at most 1000, bounded by the spec)
    published += sum(len(e.attack_list) * len(spec.seeds) * len(spec.defense_specs()) * len(spec.datasets)
                     * len(e.rounds or getattr(getattr(spec.run_model(e.run), "federated", None), "rounds", [0]))
                     for e in spec.membership if e.run is not None)
    return settings * (batches * per_batch + (len(spec.batch_sizes) if spec.utility is not None else 0)) + published


def count_trials(spec: SweepSpec) -> dict[str, int]:
    """Planned trials per kind, as :func:`~.plan.plan` makes them, without one ``TrialSpec`` per batch.

    The plan of the spec with ``images: 1`` holds one representative per batch-less setting;
    each representative of a per-batch kind stands for ``max(1, images // batch_size)`` batches.
    """
    from ..trials.plan import plan

    counts: dict[str, int] = {}
    for t in plan(spec.model_copy(update={"images": 1})):
        n = max(1, spec.images // t.batch_size) if t.images and t.batch_size else 1
        counts[t.kind] = counts.get(t.kind, 0) + n
    return counts


def _count(spec: SweepSpec) -> tuple[int, dict[str, int], bool]:
    """(trials, per kind, exact): exact from :func:`count_trials` when its representatives are few, else the bound."""
    limit = spec.max_trials or MAX_TRIALS
    representatives = _upper_bound(spec.model_copy(update={"images": 1}))
    if representatives > 4 * limit:  # counting them one by one would itself be slow: report the upper bound
        return _upper_bound(spec), {}, False
    kinds = count_trials(spec)
    return sum(kinds.values()), kinds, True


def check_size(spec: SweepSpec, *, yes: bool = False) -> int:
    """The number of planned trials; a :class:`ConfigError` past the limit (``max_trials``, else MAX_TRIALS)."""
    limit = spec.max_trials or MAX_TRIALS
    total, _, exact = _count(spec)
    if total <= limit or yes:
        return total
    raise ConfigError(f"field max_trials: the spec would make {'' if exact else 'up to '}{total:,} trials, more "
                      f"than the limit of {limit:,}; shrink images/seeds/the grids, or allow it with max_trials: "
                      f"{total} in the spec (or leakbench evaluate --yes)")


#: loop options of attacks that repeat the whole optimisation, and those that count its steps.
REPEAT_OPTIONS = ("restarts", "runs", "candidates", "trials", "tensor_trials", "directions")
STEP_OPTIONS = ("iterations", "inversion_iterations", "lbfgs_max_iter", "iters_rest", "refine", "tensor_refine")
#: the largest value of any one loop option (the papers' settings stay below 10⁵).
MAX_LOOP = 10**7
#: the largest product of an attack's loop options without ``budget.trial_seconds`` (the largest preset: 10⁸).
MAX_ATTACK_WORK = 10**9
#: the most samples one training run may pass over (epochs × samples), budget or not.
MAX_TRAIN_SAMPLES = 10**9


def attack_work(name: str, preset: str | None, options: dict[str, Any], where: str) -> int:
    """The product of attack ``name``'s loop options (its preset's values with ``options``); one too large
    single loop option is refused here, naming it."""
    from ...attacks import ATTACKS, create

    if name not in ATTACKS:
        return 1
    chosen = create(name, preset=preset, **options).options
    work = 1
    for option in (*REPEAT_OPTIONS, *STEP_OPTIONS):
        value = getattr(chosen, option, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value > MAX_LOOP:
                field = f"{where} {option}=" if where.startswith("--") else f"field {where}.options.{option}"
                raise ConfigError(f"{field}: expected at most {MAX_LOOP:,}, got {value:,}; lower it")
            work *= max(1, value)
    return work


def check_work(spec: SweepSpec) -> None:
    """Refuse attacks whose loops no budget bounds (see the module docstring), with the estimate."""
    entries = [(f"attacks[{i}]", a) for i, a in enumerate(spec.attacks)]
    entries += [(f"weights[{i}].attacks[{j}]", a) for i, w in enumerate(spec.weights) for j, a in enumerate(w.attacks)]
    for where, entry in entries:
        work = attack_work(entry.name, entry.preset, dict(entry.options), where)
        if work > MAX_ATTACK_WORK and spec.budget.trial_seconds is None:
            raise ConfigError(f"field {where}.options: about {work:,} optimisation steps per trial (the product of "
                              f"{', '.join(o for o in (*REPEAT_OPTIONS, *STEP_OPTIONS))} that apply), more than "
                              f"{MAX_ATTACK_WORK:,} with no budget; lower them or set budget.trial_seconds")
    for i, entry in enumerate(spec.membership):
        if entry.reference:  # the target and its reference models, each on half the pool, per defense and seed
            recipe = entry.recipe(spec.utility)
            samples = (entry.reference_models + 1) * recipe.epochs * (entry.pool // 2)
            if samples > MAX_TRAIN_SAMPLES:
                raise ConfigError(f"field membership[{i}].reference_models: training the target and its reference "
                                  f"models would pass about {samples:,} samples per defense ((reference_models + 1) "
                                  f"× {recipe.epochs:,} epochs × {entry.pool // 2:,}), more than "
                                  f"{MAX_TRAIN_SAMPLES:,}; lower reference_models, epochs or pool")
    for i, entry in enumerate([*spec.weights, *spec.membership]):
        if entry.target is None:  # a reference-model membership entry (checked above)
            continue
        steps = entry.target.options.get("steps")
        samples = entry.target.per_class * max(2, len(entry.target.classes or ()))
        if isinstance(steps, int) and not isinstance(steps, bool) and steps * samples > MAX_TRAIN_SAMPLES:
            section = "weights" if i < len(spec.weights) else "membership"
            k = i if i < len(spec.weights) else i - len(spec.weights)
            raise ConfigError(f"field {section}[{k}].target.options.steps: training would pass about "
                              f"{steps * samples:,} samples ({steps:,} steps × {samples:,}), more than "
                              f"{MAX_TRAIN_SAMPLES:,}; lower steps")


def _check_training(spec: SweepSpec, i: int, n: int, key: str) -> None:
    """Refuse training runs on dataset ``i`` (``n`` samples) past :data:`MAX_TRAIN_SAMPLES`, with the estimate."""
    runs = [(f"models[{j}].training.epochs", m.training.epochs) for j, m in enumerate(spec.models)]
    if spec.utility is not None:
        runs.append(("utility.epochs", spec.utility.epochs))
    for field_name, epochs in runs:
        if epochs * n > MAX_TRAIN_SAMPLES:
            raise ConfigError(f"field {field_name}: training on datasets[{i}] ({key}) would pass about "
                              f"{epochs * n:,} samples ({epochs:,} epochs × {n:,}), more than {MAX_TRAIN_SAMPLES:,}; "
                              "lower epochs or the dataset's limit")


def preflight(spec: SweepSpec, *, yes: bool = False) -> Preflight:
    """Check what every trial of ``spec`` needs (see the module docstring); one line per problem found first."""
    from ...data import load
    from ...models import MODELS, build
    from ...models.custom import imports_deferred, is_class_spec
    from ...threat import observe

    start = time.perf_counter()
    check_size(spec, yes=yes)
    total, kinds, _ = _count(spec)
    if total == 0:
        raise ConfigError("field include/exclude: the spec plans no trial (the rules exclude everything); "
                          "loosen the include/exclude rules")
    check_work(spec)
    report = Preflight(trials=total, kinds=kinds or {"trials (upper bound)": total})
    device = torch.device(spec.device)
    smallest = min(spec.batch_sizes)
    attacked = None   # the largest batch attacked per federated model, planned once when one is met
    for i, d in enumerate(spec.datasets):
        where = f"datasets[{i}] ({d.key})"
        try:
            data = load(d.name, **d.options)  # not the trials' cache: a pool's parent need not hold the data
        except Exception as err:  # noqa: BLE001 - any loader failure is the entry's problem
            raise ConfigError(f"{where}: cannot load it: {_first_line(err)}") from None
        need = max(spec.images, max(spec.batch_sizes))
        if len(data) < need:
            raise ConfigError(f"{where}: holds {len(data)} samples, the spec draws {need} (images: {spec.images}, "
                              f"batch_sizes: {list(spec.batch_sizes)}); lower them or load more samples")
        report.datasets[d.key] = (data.shape, len(data), data.num_classes)
        if not getattr(data, "labels_known", True) and any(t.get("labels_known") for t in _threat_variants(spec)):
            raise ConfigError(f"{where}: its labels are unknown (an unlabelled folder: every image carries label 0, which means nothing), but the "
                              "threat grants them (labels_known: true); remove labels_known from threat and attacks")
        _check_training(spec, i, len(data), d.key)
        _check_runs(spec, i, len(data))
        x, y = data.batch(smallest, seed=0)
        for j, m in enumerate(spec.models):
            if pair_refusal(d.name, m.spec) is not None:  # an image model on text (or back): its trials are n/a
                continue
            if imports_deferred() and is_class_spec(m.spec, MODELS.names()):
                continue  # a dry run imports no user code: the class is listed, not built
            where = f"models[{j}] ({m.key}) on datasets[{i}] ({d.key}, shape {'×'.join(map(str, data.shape))})"
            try:
                model = build(m.spec, input_shape=data.shape, classes=data.num_classes, act=m.act, init=m.init,
                              seed=m.seed, device=device, normalize=m.build_options().get("normalize"),
                              **dict(m.options))
                if m.file:
                    load_weights(model, m.file, field=f"models[{j}].file")
            except Exception as err:  # noqa: BLE001
                raise ConfigError(f"{where}: cannot build it: {_first_line(err)}") from None
            report.models += 1
            if m.federated is not None:
                if attacked is None:
                    attacked = _attacked_sizes(spec)
                _check_federated(spec, m, data, attacked.get(m.key),
                                 f"models[{j}].federated ({m.key}) on datasets[{i}] ({d.key})")
            if m.server is not None:
                model = _server_model(spec, m, j, model, data, where)
            for threat in _threat_variants(spec):
                try:
                    observe(model, x.to(device), y.to(device), seed=0, population=data, **threat)
                except Exception as err:  # noqa: BLE001
                    raise ConfigError(f"threat with {where}: one client round fails: {_first_line(err)}") from None
    for section in ("weights", "membership"):
        for i, entry in enumerate(getattr(spec, section)):
            if entry.target is not None:
                _check_target_data(entry.target, f"{section}[{i}].target")
            elif getattr(entry, "run", None) is None:  # a run's rounds: its datasets and run are checked above
                _check_pool(entry, f"membership[{i}]")
                _check_recipe(spec, entry, i)
    report.seconds = time.perf_counter() - start
    return report


def _check_runs(spec: SweepSpec, i: int, n: int) -> None:
    """Every training run on dataset ``i`` (``n`` samples) passes :func:`~.utility.check_training`, the check the
    run itself makes: a model's ``training`` and the utility recipe."""
    from ..training.utility import check_training

    for j, m in enumerate(spec.models):
        if m.training.epochs:
            check_training(m.training.epochs, m.training.batch_size, m.training.lr, n, field=f"models[{j}].training")
    if spec.utility is not None:
        u = spec.utility
        for b in (spec.batch_sizes if u.per_batch_size else [u.batch_size]):
            check_training(u.epochs, b, u.lr, n, field="utility")


def _attacked_sizes(spec: SweepSpec) -> dict[str, int]:
    """The largest batch size attacked on each federated model (its key), after the include/exclude rules."""
    from ..trials.plan import plan, split_round

    largest: dict[str, int] = {}
    for t in plan(spec.model_copy(update={"images": 1})):
        if t.kind == "attack" and "federated" in t.training:
            key = split_round(t.model_key)[0]
            largest[key] = max(largest.get(key, 0), t.batch_size)
    return largest


def _check_federated(spec: SweepSpec, m, data, largest: int | None, where: str) -> None:
    """Every seed's FedAvg layout exists (test split, public set, clients) and every client and the public set hold
    ``largest``, the largest batch attacked on this model (None: none is): the check each of the model's trials
    makes (:mod:`.federated`), made before any runs."""
    from ..training.federated import client_batch, layout

    if largest is None:
        return
    config = m.federated.run_options()
    for seed in spec.seeds:
        try:
            lay = layout(data, config, seed)
            small = min(range(len(lay.clients)), key=lambda k: len(lay.clients[k]))
            client_batch(data, config, seed, small, largest)
            if config["public"]:
                client_batch(data, config, seed, 0, largest, public=True)
        except ConfigError as err:
            raise ConfigError(f"{where}, seed {seed}: {err}") from None


def _check_recipe(spec: SweepSpec, entry, i: int) -> None:
    """A reference-model membership entry's training runs and canary audit pass the checks they make at run time:
    :func:`~.utility.check_training` on ⌊pool/2⌋ points (the target and every reference model train on half the
    pool), a known loss, and :func:`~.audit.check_canaries`."""
    from ...losses import LOSSES
    from ..membership.audit import check_canaries
    from ..training.utility import check_training

    recipe = entry.recipe(spec.utility)
    field_name = f"membership[{i}].training" if entry.training is not None else (
        "utility" if spec.utility is not None else f"membership[{i}].training (default)")
    check_training(recipe.epochs, recipe.batch_size, recipe.lr, entry.pool // 2, field=field_name)
    if recipe.loss not in LOSSES:
        raise ConfigError(f"expected loss one of {', '.join(LOSSES.names())}, got {recipe.loss!r} (field "
                          f"{field_name}.loss)")
    if entry.canaries:
        check_canaries(entry.canaries, field=f"membership[{i}].canaries")


def _check_pool(entry, where: str) -> None:
    """A reference-model membership entry's dataset loads and holds its pool."""
    from ...data import load

    try:
        n = len(load(entry.dataset.name, **dict(entry.dataset.options)))
    except Exception as err:  # noqa: BLE001
        raise ConfigError(f"field {where}.dataset: cannot load {entry.dataset.key!r}: {_first_line(err)}") from None
    if entry.pool > n:
        raise ConfigError(f"field {where}.pool: expected a pool of at most {n} points (dataset {entry.dataset.key!r} "
                          f"holds {n}), got {entry.pool}; lower pool or use a larger dataset (e.g. photos with "
                          "scale: 1 holds 3 617)")


def _threat_variants(spec: SweepSpec) -> list[dict[str, Any]]:
    """The distinct observe() arguments of the spec's threat section and of its attacks' overrides."""
    variants: dict[str, dict[str, Any]] = {}
    for overrides in [{}] + [a.threat for a in spec.attacks]:
        threat = {**_threat_arguments(spec), **overrides}
        variants.setdefault(repr(sorted(threat.items())), threat)
    return list(variants.values())


def _server_model(spec: SweepSpec, entry, j: int, model, data, where: str):
    """The model the server ships, built once (a bad option value or too little public data fails here)."""
    from ..trials.trial import TrialSpec
    from ..trials.inputs import apply_server

    name, options = entry.server.move
    largest = max(spec.batch_sizes)
    probe = TrialSpec(kind="attack", dataset="", model=entry.spec, batch_size=largest, images=spec.images,
                      server={"move": name, "options": options, "public": entry.server.public})
    try:
        return apply_server(probe, model, data)
    except Exception as err:  # noqa: BLE001
        raise ConfigError(f"models[{j}].server.{name} with {where}: cannot ship it: {_first_line(err)}") from None


def _check_target_data(target, where: str) -> None:
    """The published model's data: loadable, its kept classes known, members and non-members available."""
    from ...data import load
    from ..membership.published import _kept

    try:
        data = _kept(load(target.dataset.name, **target.dataset.options), target.classes)
    except Exception as err:  # noqa: BLE001
        raise ConfigError(f"{where}: cannot load its data: {_first_line(err)}") from None
    counts = torch.bincount(data.labels.cpu(), minlength=data.num_classes)
    short = [data.classes[c] for c in range(data.num_classes) if int(counts[c]) <= target.per_class]
    if short:
        raise ConfigError(f"{where}.per_class: {target.per_class} training samples per class leave no non-member "
                          f"of class {short[0]!r} ({int(counts[data.classes.index(short[0])])} samples); lower "
                          "per_class or keep other classes")


def _threat_arguments(spec: SweepSpec) -> dict[str, Any]:
    """The observe() arguments of the spec's threat section (as the trials pass them; other keys are left out)."""
    from ...threat import observe

    accepted = inspect.signature(observe).parameters
    return {k: v for k, v in spec.threat.model_dump().items() if k in accepted}


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    text = text[:300]
    return text if isinstance(err, LeakbenchError) else f"{type(err).__name__}: {text}"


__all__ = ["Preflight", "preflight", "count_trials", "check_size", "check_work", "attack_work", "MAX_LOOP",
           "MAX_ATTACK_WORK", "MAX_TRAIN_SAMPLES"]
