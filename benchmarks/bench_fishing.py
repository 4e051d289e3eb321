"""Class fishing read by gradient matching on a ConvNet without a first FC layer (Wen et al., ICML 2022, Sec. 3–4).

The server ships ``fishing(model, target=3)``; the client's batch holds exactly one class-3 digit and B − 1 digits
of other classes.  ``fishing`` (read-out ``matching``) inverts the fished gradient as a batch of one of class 3
(the layers below the head; :mod:`leakbench.attacks.gradient.fishing`).  Score: the PSNR of slot 0 against the one
class-3 sample.  Chance rows, in the same metric against the same sample: the grey image at that sample's own mean
(a strong grey: its mean is not known to the attacker); the same read-out on the **honest** model's batch gradient
(the model unmodified, the same B = 1 inversion with label 3: what fishing adds); a random non-member image of
class 3 from the same pool (not in the batch).

Set-up: scikit-learn's digits at 16×16, ``convnet-16`` untrained (seed 0) and trained as in
``bench_learned_prior`` (10 epochs SGD on digits 0–999, batch 16, lr 0.05; its held-out accuracy printed); the
fishing head calibrated on digits 0–255 (public, never attacked).  Batches from the **report pool** (digits
1 300–1 796) or, with ``LEAKBENCH_FISH_POOL=tuning``, the **tuning pool** (1 000–1 299) where the engine was chosen.
Batch b: the b-th class-3 digit of a seeded permutation of the pool, and B − 1 non-class-3 digits of the pool drawn
with seed 1000·B + b.  The B = 1 problems of one model are solved as one stacked optimisation.

``LEAKBENCH_FISH_B=8,32`` batch sizes, ``LEAKBENCH_FISH_N=8`` batches, ``LEAKBENCH_FISH_ENGINE=fast`` the
inverting-gradients preset (``LEAKBENCH_FISH_ENGINE_TRAINED`` for the trained net, default ``trained``),
``LEAKBENCH_FISH_ITERATIONS`` an override of its iterations, ``LEAKBENCH_FISH_NETS=untrained,trained``,
``LEAKBENCH_FISH_PARTS=class,feature`` which tables.

**Feature fishing** (Sec. 3.2, the single-round variant; second table): B = 32 batches holding exactly three
class-3 digits (the b-th triple of the class-3 permutation) and 29 others; the server ships
``fishing(model, target=3, quantile=1/3)`` (about one of three class-3 samples below the threshold; the feature
chosen and the threshold placed on labelled public digits 0–999, never attacked), the same matching read-out
inverts slot 0.  The intended sample: the class-3 digit of the batch with the lowest value of the chosen feature
(the one the threshold lets through most).  Rows: how many batches let exactly one class-3 digit through (φ_j < τ)
with no other-class digit above τ (the construction's leak); how often slot 0's nearest batch image (PSNR) is the
intended sample, for feature fishing, for class fishing on the same batches (a mixture of the three), and chance
(1/3: one of the class's three); the mean PSNR of slot 0 against the intended sample beside the grey image and a
random class-3 non-member.
"""
from __future__ import annotations

import copy
import os
import time

import torch

import leakbench as lb
from leakbench.attacks import attack_batch
from leakbench.evaluation.training.utility import loss_and_accuracy, train_model
from leakbench.evaluation.verdicts.stats import binomial, bootstrap_mean
from leakbench.models.active import fishing

from .common import console, env_ints, env_names, psnr, table

MODEL, TARGET, SIZE = "convnet-16", 3, 16
RECIPE = (10, 16, 0.05)  # epochs, batch, lr (bench_learned_prior's)
TRAIN, PUBLIC = range(0, 1000), range(0, 256)
POOLS = {"report": range(1300, 1797), "tuning": range(1000, 1300)}


def batches(ds: lb.ImageDataset, pool: str, size: int, count: int, *, fished: int = 1, seed: int = 7,
            stride: int = 1000) -> list[tuple[list[int], int]]:
    """``count`` batches of ``size`` holding exactly ``fished`` class-3 digits (the first slots), and a class-3
    non-member of the pool each; the class-3 digits come from a permutation seeded ``seed``, the others from one
    seeded ``stride·size + b`` per batch b."""
    idx = list(POOLS[pool])
    labels = ds.labels[idx]
    targets = [idx[i] for i in torch.randperm(len(idx), generator=torch.Generator().manual_seed(seed)).tolist()
               if int(labels[i]) == TARGET]
    others = [i for i, y in zip(idx, labels.tolist()) if y != TARGET]
    need = (fished + 1) * count
    if need > len(targets):
        raise SystemExit(f"{count} batches need {need} class-{TARGET} digits; pool {pool} holds {len(targets)}")
    out = []
    for b in range(count):
        pick = torch.randperm(len(others), generator=torch.Generator().manual_seed(stride * size + b))[:size - fished]
        out.append(([*targets[fished * b:fished * (b + 1)], *[others[i] for i in pick.tolist()]],
                    targets[fished * count + b]))
    return out


def _model(ds: lb.ImageDataset, trained: bool, quick: bool) -> tuple[torch.nn.Module, float]:
    model = lb.build(MODEL, input_shape=ds.shape, classes=ds.num_classes, seed=0)
    if trained:
        epochs, batch, lr = RECIPE
        model = train_model(model, ds.subset(list(TRAIN)), epochs=2 if quick else epochs, batch_size=batch, lr=lr,
                            seed=0).model
    model = model.eval()
    held = list(range(len(TRAIN), len(ds.labels)))
    return model, loss_and_accuracy(model, ds.images[held], ds.labels[held])[1]


def _cell(values: list[float]) -> str:
    iv = bootstrap_mean(values)
    return f"{iv.mean:.2f} [{iv.low:.2f}, {iv.high:.2f}]"


def _feature(model: torch.nn.Module, x: torch.Tensor, j: int) -> torch.Tensor:
    """Feature j of the final layer's input for the images ``x``."""
    seen: list[torch.Tensor] = []
    handle = model.fc.register_forward_hook(lambda m, i, o: seen.append(i[0][:, j].detach()))
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen[0]


def _nearest(image: torch.Tensor, x: torch.Tensor) -> int:
    return int(((x - image.clamp(0, 1)) ** 2).reshape(len(x), -1).mean(1).argmin())


def feature_table(ds: lb.ImageDataset, pool: str, count: int, iterations: int | None, nets: list[str],
                  quick: bool, start: float) -> None:
    size = 32
    rows = []
    for net in nets:
        model, acc = _model(ds, net == "trained", quick)
        engine = os.environ.get(f"LEAKBENCH_FISH_ENGINE{'_TRAINED' if net == 'trained' else ''}",
                                "trained" if net == "trained" else "fast")
        options = {"readout": "matching", "engine": engine, **({"iterations": iterations} if iterations else {})}
        public = (ds.images[list(TRAIN)], ds.labels[list(TRAIN)])
        featured = fishing(model, target=TARGET, quantile=1 / 3, calibration=public)
        classed = fishing(model, target=TARGET, calibration=public[0][:256])
        j, tau = featured.fishing_feature, featured.fishing_threshold
        drawn = batches(ds, pool, size, count, fished=3, seed=11, stride=2000)
        pairs = [ds.batch(indices=i) for i, _ in drawn]
        phis = [_feature(featured, x.to(torch.float32), j) for x, _ in pairs]
        intended = [int(phi[:3].argmin()) for phi in phis]
        clean = sum(int((phi[:3] < tau).sum()) == 1 and int((phi[3:] > tau).sum()) == 0 for phi in phis)
        passed = sum(int((phi[:3] < tau).sum()) for phi in phis) / count
        leaked = sum(int((phi[3:] > tau).sum()) for phi in phis) / count
        truth = [x[i:i + 1] for (x, _), i in zip(pairs, intended)]
        label = f"{net} (acc {acc:.2f}), feature {j}, τ {tau:.3f}"
        iv = binomial(clean, count)
        rows.append([label, "one class-3 digit through, no leak", f"{clean} of {count} [{iv.low:.2f}, {iv.high:.2f}]",
                     f"mean {passed:.2f} of 3 through, {leaked:.2f} of 29 others leak"])
        found = {}
        for name, shipped in (("feature fishing", featured), ("class fishing (same batches)", classed)):
            recs = attack_batch("fishing", [lb.observe(shipped, x, y) for x, y in pairs], seeds=list(range(count)),
                                **options)
            failed = sum(isinstance(r, Exception) for r in recs)  # a diverged run: nothing recovered (grey)
            slots = [torch.full_like(t, 0.5) if isinstance(r, Exception) else r.images[0:1].cpu()
                     for r, t in zip(recs, truth)]
            hits = sum(not isinstance(r, Exception) and _nearest(r.images[0].cpu(), x) == i
                       for r, (x, _), i in zip(recs, pairs, intended))
            iv = binomial(hits, count)
            found[name] = [psnr(s, t) for s, t in zip(slots, truth)]
            rows.append([label, f"{name}: slot 0 nearest the intended digit",
                         f"{hits} of {count} [{iv.low:.2f}, {iv.high:.2f}]",
                         f"PSNR {_cell(found[name])}" + (f"; {failed} diverged (scored as grey)" if failed else "")])
        rows.append([label, "chance: a random one of the class's three (of the batch's)", f"1/3 (1/{size})", "–"])
        rows.append([label, "grey at the intended digit's mean", "–",
                     f"PSNR {_cell([psnr(torch.full_like(t, float(t.mean())), t) for t in truth])}"])
        rows.append([label, "random class-3 non-member", "–",
                     f"PSNR {_cell([psnr(ds.images[m:m + 1], t) for (_, m), t in zip(drawn, truth)])}"])
        console.print(f"[dim]{label}: done ({time.perf_counter() - start:.0f} s)[/dim]", highlight=False)
    table(f"Feature fishing (single round, quantile 1/3): B = {size} with three class-{TARGET} digits, {MODEL} on "
          f"digits {SIZE}×{SIZE}, {count} batches ({pool} pool)",
          ["network", "row", "batches [95 % Clopper–Pearson]", "detail [95 % bootstrap]"], rows,
          f"feature and threshold from labelled public digits 0–999; iterations {iterations or 'the preset'}s; "
          f"{time.perf_counter() - start:.0f} s on {torch.get_num_threads()} thread(s), under load.")


def run(*, quick: bool = False) -> None:
    sizes = env_ints("LEAKBENCH_FISH_B", "8" if quick else "8,32")
    count = env_ints("LEAKBENCH_FISH_N", "2" if quick else "8")[0]
    pool = os.environ.get("LEAKBENCH_FISH_POOL", "report")
    if pool not in POOLS:
        raise SystemExit(f"LEAKBENCH_FISH_POOL: unknown pool {pool!r}; known: {', '.join(POOLS)}")
    nets = env_names("LEAKBENCH_FISH_NETS") or ["untrained", "trained"]
    if unknown := [n for n in nets if n not in ("untrained", "trained")]:
        raise SystemExit(f"LEAKBENCH_FISH_NETS: unknown {', '.join(unknown)}; known: untrained, trained")
    iterations = env_ints("LEAKBENCH_FISH_ITERATIONS", "50" if quick else "0")[0] or None
    parts = env_names("LEAKBENCH_FISH_PARTS") or ["class", "feature"]
    start = time.perf_counter()
    ds = lb.load("digits", size=SIZE)
    if "feature" in parts:
        feature_table(ds, pool, count, iterations, nets, quick, start)
    if "class" not in parts:
        return
    rows = []
    for net in nets:
        model, acc = _model(ds, net == "trained", quick)
        engine = os.environ.get(f"LEAKBENCH_FISH_ENGINE{'_TRAINED' if net == 'trained' else ''}",
                                "trained" if net == "trained" else "fast")
        options = {"readout": "matching", "engine": engine, **({"iterations": iterations} if iterations else {})}
        shipped = fishing(model, target=TARGET, calibration=ds.images[list(PUBLIC)])
        honest = copy.deepcopy(model)  # the same read-out on the unmodified model's gradient
        honest.fishing_target, honest.fishing_head = TARGET, shipped.fishing_head
        label = f"{net} (acc {acc:.2f}), engine {engine}"
        for B in sizes:
            drawn = batches(ds, pool, B, count)
            pairs = [ds.batch(indices=i) for i, _ in drawn]
            truth = [x[0:1] for x, _ in pairs]
            scores: dict[str, list[float]] = {"grey at the sample's mean": [
                psnr(torch.full_like(t, float(t.mean())), t) for t in truth]}
            scores["random class-3 non-member"] = [psnr(ds.images[m:m + 1], t) for (_, m), t in zip(drawn, truth)]
            counts = []
            for name, m in (("fishing, honest model (same read-out)", honest), ("fishing (fished model)", shipped)):
                obs = [lb.observe(m, x, y) for x, y in pairs]
                recs = attack_batch("fishing", obs, seeds=list(range(count)), **options)
                if bad := [r for r in recs if isinstance(r, Exception)]:
                    raise SystemExit(f"{name} failed: {bad[0]}")
                scores[name] = [psnr(r.images[0:1].cpu(), t) for r, t in zip(recs, truth)]
                counts = [r.trace["fished_count_estimate"] for r in recs]
            fished = scores["fishing (fished model)"]
            for name, values in scores.items():
                above = "–" if name.startswith("fishing (") else \
                    f"{sum(f > v for f, v in zip(fished, values))} of {count}"
                rows.append([label, B, name, _cell(values), above])
            console.print(f"[dim]{label}, B = {B}: n̂ of the fished batches {', '.join(f'{c:.3f}' for c in counts)} "
                          f"({time.perf_counter() - start:.0f} s)[/dim]", highlight=False)
    table(f"Class fishing read by gradient matching: PSNR (dB) of slot 0 against the batch's one class-{TARGET} "
          f"digit, {MODEL} on digits {SIZE}×{SIZE}, {count} batches per B ({pool} pool)",
          ["network", "B", "row", "mean PSNR [95 % bootstrap]", "fished above it (paired)"], rows,
          f"fished model calibrated on digits 0–255; trained net: digits 0–999; attacked pool {pool} (digits "
          f"{POOLS[pool].start}–{POOLS[pool].stop - 1}); iterations {iterations or 'the preset'}s; "
          f"{time.perf_counter() - start:.0f} s on {torch.get_num_threads()} thread(s), under load.")
