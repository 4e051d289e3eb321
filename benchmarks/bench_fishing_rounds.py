"""Multi-round feature fishing (``fishing-rounds``, Wen et al., ICML 2022, Sec. 3.2) against the single round.

The server ships ``fishing(model, target=3, quantile=0.5)`` (the feature and its threshold placed on labelled
public images that are never attacked), then re-queries the same client at thresholds it chooses
(``obs.extras["query"]``, :func:`leakbench.requery`) and reads each sample that two rounds tell apart from their
difference, exactly, from the first FC layer's rows.  Beside it on the same shipped model and batch: ``fishing``
(the single round, rows read-out: the class-3 samples below the threshold that are alone on a row), and the
rounds ``fishing-rounds`` needs for its first sample (``want=1``; the paper's ~log₂ n).  Chance in the same metric
(exact = max-abs error ≤ 1e-4 of the data range after matching each claimed slot to its nearest original): the grey
image and B random non-members of the pool.  A defended row: Gaussian noise on every round (fresh each round).

Set-up: ``mlp:1000`` (ReLU), untrained and trained (SGD, 5 epochs, batch 32, lr 0.05, seed 0; held-out accuracy
printed), on scikit-learn's digits (8×8; trained on 0–999, public 1 000–1 299, attacked 1 300+) and, when
../shared/data/cifar10-test-1000.npz is present, CIFAR-10 at 16×16 (by index mod 100: trained on < 30, public
30–49, attacked ≥ 50).  ``LEAKBENCH_FR_B=32,64`` batch sizes, ``LEAKBENCH_FR_N=4``
batches per size, ``LEAKBENCH_FR_ROUNDS=96`` the round budget.
"""
from __future__ import annotations

import time

import torch

import leakbench as lb
from leakbench.errors import NothingRecovered
from leakbench.evaluation.training.utility import loss_and_accuracy, train_model
from leakbench.evaluation.verdicts.stats import binomial
from leakbench.models.active import fishing

from .common import benchmark_images, console, env_ints, resized, table

MODEL, TARGET, EXACT = "mlp:1000", 3, 1e-4


def _sets(quick: bool):
    digits = lb.load("digits")
    out = [("digits 8×8", digits, list(range(0, 1000)), list(range(1000, 1300)), list(range(1300, len(digits))))]
    if quick:
        return out
    ds, source = benchmark_images(1000)
    if source.startswith("CIFAR"):
        ds = resized(ds, 16)   # 100 images per class, in class order: split by index mod 100
        out.append(("CIFAR-10 16×16", ds, [i for i in range(1000) if i % 100 < 30],
                    [i for i in range(1000) if 30 <= i % 100 < 50], [i for i in range(1000) if i % 100 >= 50]))
    return out


def _exact(images: torch.Tensor, claimed: torch.Tensor, x: torch.Tensor, width: float) -> tuple[int, int]:
    """(claimed slots within EXACT of their nearest original, distinct originals so read)."""
    b = x.shape[0]
    if not bool(claimed.any()):
        return 0, 0
    r = images[claimed].reshape(int(claimed.sum()), -1).double()
    err = (r[:, None] - x.reshape(b, -1).double()[None]).abs().amax(-1)
    best, which = err.min(1)
    ok = best <= EXACT * width
    return int(ok.sum()), len(set(which[ok].tolist()))


def _chance(images: torch.Tensor, x: torch.Tensor, width: float) -> int:
    return _exact(images, torch.ones(images.shape[0], dtype=torch.bool), x, width)[1]


def _interval(k: int, n: int) -> str:
    ci = binomial(k, n)
    return f"{k}/{n} [{100 * ci.low:.1f}, {100 * ci.high:.1f}] %"


def run(*, quick: bool = False) -> None:
    sizes = [32] if quick else env_ints("LEAKBENCH_FR_B", "32,64")
    count = 1 if quick else env_ints("LEAKBENCH_FR_N", "4")[0]
    budget = env_ints("LEAKBENCH_FR_ROUNDS", "96")[0]
    rows = []
    start = time.perf_counter()
    for label, ds, train, public, pool in _sets(quick):
        lo, hi = float(ds.images.min()), float(ds.images.max())
        for trained in ([False] if quick else [False, True]):
            model = lb.build(MODEL, input_shape=ds.shape, classes=ds.num_classes, seed=0)
            if trained:
                model = train_model(model, ds.subset(train), epochs=5, batch_size=32, lr=0.05, seed=0).model
            model.eval()
            _, acc = loss_and_accuracy(model, ds.images[pool], ds.labels[pool])
            shipped = fishing(model, target=TARGET, quantile=0.5, calibration=ds.subset(public))
            for B, defense in [(b, "none") for b in sizes] + ([(sizes[0], "noise:0.001")] if not quick else []):
                order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(B)).tolist()
                if B * (count + 1) > len(pool):
                    raise SystemExit(f"{count} batches of {B} need {B * (count + 1)} images; {label} has {len(pool)}")
                t = {"multi": 0, "false": 0, "single": 0, "grey": 0, "other": 0}
                used, first, secs, why = [], [], [], ""
                for b in range(count):
                    x, y = ds.batch(indices=[pool[i] for i in order[b * B:(b + 1) * B]])
                    non = ds.batch(indices=[pool[i] for i in order[count * B:(count + 1) * B]])[0]
                    obs = lb.observe(shipped, x, y, defense=defense, seed=b)
                    obs.extras["query"] = lb.requery(x, y, defense=defense, seed=b)
                    t0 = time.perf_counter()
                    try:
                        rec = lb.attack("fishing-rounds", obs, rounds=budget)
                        claimed = rec.confidence > 0
                        ok, distinct = _exact(rec.images, claimed, x, hi - lo)
                        t["multi"] += distinct
                        t["false"] += int(claimed.sum()) - ok
                        used.append(rec.trace["rounds_used"])
                        one = lb.attack("fishing-rounds", obs, rounds=budget, want=1)
                        first.append(one.trace["rounds_used"])
                    except NothingRecovered as err:
                        why = str(err).split("(")[-1].split(":")[0].strip()   # e.g. "counts up to 0.5 off an integer"
                    secs.append(time.perf_counter() - t0)
                    try:
                        single = lb.attack("fishing", obs, readout="rows")
                        t["single"] += _exact(single.images, single.confidence > 0, x, hi - lo)[1]
                    except NothingRecovered:
                        pass
                    t["grey"] += _chance(torch.full_like(x, (lo + hi) / 2), x, hi - lo)
                    t["other"] += _chance(non, x, hi - lo)
                n = B * count
                row = [label, f"{'trained' if trained else 'untrained'} ({acc:.3f})", B, defense,
                       _interval(t["multi"], n), t["false"],
                       f"{min(used)}–{max(used)}" if used else f"— ({why})",
                       f"{min(first)}–{max(first)}" if first else "—", _interval(t["single"], n),
                       f"{t['grey']}/{n}", f"{t['other']}/{n}", f"{max(secs):.1f}"]
                rows.append(row)
                console.print(f"[dim]{' | '.join(map(str, row))} ({time.perf_counter() - start:.0f} s)[/dim]",
                              highlight=False)
    table("fishing-rounds: samples read exactly from differences of rounds, against one round of feature fishing",
          ["data", "model (held-out acc.)", "B", "defense", "multi-round exact (95 % CI)", "false claims",
           "rounds used", "rounds to the first", "single round exact (95 % CI)", "grey exact",
           "random non-members exact", "s per batch (max)"], rows,
          f"{MODEL}, fishing(target={TARGET}, quantile=0.5) calibrated on public images; {count} batch(es) per row, "
          f"n = B × batches; exact = max-abs error ≤ {EXACT:g} of the range, distinct originals; round budget "
          f"{budget} (the shipped round included); {time.perf_counter() - start:.0f} s on "
          f"{torch.get_num_threads()} thread(s).")
