"""SPEAR against the other analytic batch attacks on ReLU MLPs, and under defenses.

1. ``mlp:1000`` and ``mlp:1000-1000`` (ReLU, untrained, eval mode), undefended gradients of digits upsampled to
   28×28, three batches per B: samples recovered exactly (above 60 dB after the best one-to-one matching),
   certified, and certified yet wrong (max-abs error > 1e-4), and seconds, of ``spear``, beside ``exclusivity`` and
   ``cocktail-party`` (first batch) and a grey image (the data-range centre), with the numerical rank of ∂L/∂W
   (SPEAR's factorisation needs rank B; these digits are 8×8 images upsampled, so a batch lives in ~55
   dimensions, and spear's peeling reaches past that).
2. The same on CIFAR-10 test images as 3 072-vectors when ../shared/data/cifar10-test-1000.npz is present
   (indices ≥ 500 only: below 500 is the tuning range of the gradient-matching presets).
3. Under defenses (digits, B = 16): noise, clipping and DP-SGD — how far SPEAR's exactness degrades.
3b. Federated (``federated``): FedAvg clients' updates after several local steps (``local:k,lr`` and
   minibatch epochs ``local:k,lr,b``), alone and followed by clipping or noise, on digits-like 28×28 batches of
   B = 32 (deform=1, full rank) for ``mlp:1000`` untrained and trained (held-out accuracy stated): exact,
   certified (the replay certificate), falsely certified, the replay's misfit, and two controls in the same
   terms — the replay's misfit when one recovered sample is swapped for a non-member (what a wrong batch
   scores against the certificate's threshold) and the grey image's exact count and PSNR.
4. Large B (not in ``--quick``): B = 128 on ``mlp:1000`` and B = 256 on ``mlp:2000`` (m ≥ 2B), on linearly independent 28×28
   digits — real MNIST test images when ``LEAKBENCH_MNIST`` names a folder of its IDX files, else the bundled
   digits with a seeded affine + elastic warp per image (``lb.load("digits", size=28, deform=1, seed=1)``;
   upsampled alone they span ~55 dimensions) — and on CIFAR-10 test images 500–999, two seeded batches per row,
   beside exclusivity and cocktail-party (first batch) and two chance rows in the same metric and matching:
   the grey image (data-range centre) and as many random dataset images not in the batch.

``--quick`` runs B = 8, 16, 32 and fewer defense settings.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import torch
from scipy.stats import binomtest

import leakbench as lb
from leakbench.errors import NothingRecovered

from .common import CIFAR_NPZ, console, table

BATCHES = (8, 16, 32, 64, 128)
QUICK_BATCHES = (8, 16, 32)


def _scores(rec_or_images, x: torch.Tensor) -> torch.Tensor:
    """Per-original PSNR after the library's matching (confident-first when the attack flags exact slots)."""
    return torch.tensor(lb.compare(rec_or_images, x)["per_sample"]["psnr"])


def _timed(name: str, obs, **options):
    start = time.perf_counter()
    rec = lb.attack(name, obs, **options)
    return rec, time.perf_counter() - start


def _matched(rec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per original, after matching: PSNR, max-abs error and whether its reconstruction is certified."""
    scores = lb.compare(rec, x)
    order = torch.tensor(scores["order"])
    b = x.shape[0]
    err = (x.reshape(b, -1).double() - rec.images.reshape(b, -1).double()[order]).abs().amax(1)
    return torch.tensor(scores["per_sample"]["psnr"]), err, rec.confidence.bool()[order]


def _spear_counts(obs, x: torch.Tensor) -> tuple[int, int, int, float, int]:
    """exact (> 60 dB), certified, falsely certified (max-abs error > 1e-4 after matching), seconds, rank."""
    rec, seconds = _timed("spear", obs)
    psnr, err, certified = _matched(rec, x)
    return (int((psnr > 60).sum()), int(certified.sum()), int((certified & (err > 1e-4)).sum()), seconds,
            rec.trace["rank"])


def _curve(label: str, batches, model, quick: bool, others: bool) -> list[tuple]:
    """One row per B: spear summed over the batches (n = batches × B), the others on the first batch only."""
    rows = []
    for batch, pairs in batches:
        counts = [_spear_counts(lb.observe(model, x, y), x) for x, y in pairs]
        total = batch * len(pairs)
        exact, cert, false = (sum(c[i] for c in counts) for i in range(3))
        row = [label, batch, len(pairs), "/".join(str(c[4]) for c in counts), f"{exact}/{total}", cert, false,
               max(c[3] for c in counts)]
        x, y = pairs[0]
        if others:
            obs = lb.observe(model, x, y)
            try:
                excl, t_excl = _timed("exclusivity", obs)
                p_excl = _scores(excl, x)
            except NothingRecovered:  # no sample identified: nothing exact
                p_excl, t_excl = torch.zeros(0), math.nan
            cpa, t_cpa = _timed("cocktail-party", obs, preset="quick" if quick else None)
            p_cpa = _scores(cpa.images.clamp(0, 1), x)
            row += [f"{int((p_excl > 60).sum())}/{batch}", t_excl,
                    f"{int((p_cpa > 60).sum())}/{batch} ({float(p_cpa.median()):.1f} dB)", t_cpa]
        row.append(float(_scores(torch.full_like(x, 0.5), x).median()))
        rows.append(tuple(row))
    return rows


COLUMNS = ["data", "B", "batches", "rank ∂W", "spear exact", "certified", "false cert.", "spear s (max)"]
OTHERS = ["exclusivity exact (1st)", "excl. s", "cocktail-party exact (median, 1st)", "CPA s"]


def digits(quick: bool) -> None:
    data = lb.load("digits", size=28)
    rows = []
    for arch in ("mlp:1000",) if quick else ("mlp:1000", "mlp:1000-1000"):
        model = lb.build(arch, input_shape=data.shape, classes=10, seed=0)
        seeds = (0,) if quick else (0, 1, 2)
        sizes = QUICK_BATCHES if quick else (BATCHES if arch == "mlp:1000" else (32, 64))
        batches = [(b, [data.batch(b, seed=100 * k + b) for k in seeds]) for b in sizes]
        rows += _curve(f"digits 28×28, {arch}", batches, model, quick, others=True)
    table("exact samples (> 60 dB, matched) against B: ReLU MLPs, untrained, undefended",
          COLUMNS + OTHERS + ["grey dB"], rows,
          note="batches: data.batch(B, seed=100·k + B), k = 0, 1, 2 (quick: k = 0); exact/certified summed over "
               "them (n = batches × B); false cert.: certified yet more than 1e-4 off (max-abs); exclusivity and "
               "cocktail-party on the first batch; times on this machine, shared with other work")


def cifar(quick: bool) -> None:
    if not CIFAR_NPZ.exists():
        table("CIFAR-10 as 3 072-vectors", ["skipped"], [(f"{CIFAR_NPZ} absent",)])
        return
    from leakbench.data.cifar import CIFAR10_CLASSES

    data = lb.load("npz", path=str(CIFAR_NPZ), classes=list(CIFAR10_CLASSES))
    model = lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=0)
    batches = []
    for batch in QUICK_BATCHES if quick else BATCHES:
        starts = [500] if quick else [500 + k * batch for k in range(2 if batch <= 64 else 1)]
        batches.append((batch, [(data.images[s:s + batch], data.labels[s:s + batch]) for s in starts]))
    columns = COLUMNS + ([] if quick else OTHERS)
    table("exact samples against B on CIFAR-10 test images 500… (mlp:1000 on 3 072-vectors)", columns + ["grey dB"],
          _curve("CIFAR-10", batches, model, quick, others=not quick),
          note="batches: consecutive test images from 500 (two per B up to 64, one at 128)")


def defended(quick: bool) -> None:
    data = lb.load("digits", size=28)
    model = lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=0)
    x, y = data.batch(16, seed=7)
    settings = ["none", "clip:1", "noise:1e-7", "noise:1e-6", "noise:1e-4", "dpsgd:1,0.01"] if quick else \
        ["none", "clip:1", "clip:0.01", "noise:1e-7", "noise:1e-6", "noise:1e-5", "noise:1e-4", "noise:1e-3",
         "dpsgd:1,0.001", "dpsgd:1,0.01", "dpsgd:1,0.1", "dpsgd:1,1"]
    grey = float(_scores(torch.full_like(x, 0.5), x).median())
    rows = []
    for defense in settings:
        obs = lb.observe(model, x, y, defense=defense, seed=0)
        rec, seconds = _timed("spear", obs)
        psnr = _scores(rec, x)
        exact, cert, false, _, _ = _spear_counts(obs, x)
        rows.append((defense, f"{exact}/16", cert, false, float(psnr.median()), float(psnr.min()), seconds, grey))
    table("spear under defenses: digits 28×28, B = 16, mlp:1000", ["defense", "exact", "certified", "false cert.",
          "median dB", "min dB", "seconds", "grey dB"], rows,
          note="clipping rescales the whole gradient (zeros and span unchanged); noise and DP-SGD fill the zeros")


#: B and the ReLU MLP of each large-B row (m ≥ 2B; at B = 256, mlp:1000 reached 30/256 and mlp:2000 55/256 of
#: one digits-like batch in a tuning run on deform seed 0, so the row uses the wider one)
LARGE = ((128, "mlp:1000"), (256, "mlp:2000"))
#: batches per large-B row (seeded draws; CIFAR-10 from test images 500–999)
LARGE_BATCHES = 2


def _rate(k: int, n: int) -> str:
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return f"{k}/{n} [{ci.low:.0%}, {ci.high:.0%}]"


def _large_data():
    """(label, dataset, indices a batch is drawn from) for the digits-like and CIFAR-10 rows."""
    out = []
    mnist = os.environ.get("LEAKBENCH_MNIST")
    if mnist:
        data = lb.load("mnist", root=mnist, train=False)
        out.append((f"MNIST test ({mnist})", data, np.arange(len(data))))
    else:
        data = lb.load("digits", size=28, deform=1.0, seed=1)
        out.append(("digits-like: digits 28×28, deform=1, seed=1", data, np.arange(len(data))))
    if CIFAR_NPZ.exists():
        from leakbench.data.cifar import CIFAR10_CLASSES

        data = lb.load("npz", path=str(CIFAR_NPZ), classes=list(CIFAR10_CLASSES))
        out.append(("CIFAR-10 test 500–999", data, np.arange(500, len(data))))
    return out


def large(batches: int = LARGE_BATCHES) -> None:
    """B = 128 on ``mlp:1000`` and 256 on ``mlp:2000``: spear against exclusivity, cocktail-party and the two chance rows
    (``batches`` seeded batches a row)."""
    rows = []
    for label, data, pool in _large_data():
        for batch, arch in LARGE:
            model = lb.build(arch, input_shape=data.shape, classes=10, seed=0)
            with torch.no_grad():
                acc = float((model(data.images).argmax(1) == data.labels).float().mean())
            counts, grey, rand = [], [], []
            for k in range(batches):
                order = np.random.default_rng([batch, k]).permutation(pool)
                x, y = data.batch(indices=order[:batch])
                obs = lb.observe(model, x, y)
                lo, hi = obs.data_range
                counts.append(_spear_counts(obs, x))
                console.print(f"[dim]{label}, {arch}, B = {batch}, batch {k}: exact {counts[-1][0]}, certified "
                              f"{counts[-1][1]}, false {counts[-1][2]}, {counts[-1][3]:.0f} s[/dim]")
                grey.append(_scores(torch.full_like(x, (lo + hi) / 2), x))
                # random dataset images not in the batch (outside the pool too when the pool is short)
                others = np.setdiff1d(np.arange(len(data)), order[:batch])
                pick = np.random.default_rng([batch, k, 1]).choice(others, batch, replace=False)
                rand.append(_scores(data.images[pick], x))
                if k == 0:
                    first = (obs, x)
            n = batch * batches
            exact, cert, false = (sum(c[i] for c in counts) for i in range(3))
            grey_p, rand_p = torch.cat(grey), torch.cat(rand)
            obs, x = first
            try:
                excl, _ = _timed("exclusivity", obs)
                p_excl = _scores(excl, x)
            except NothingRecovered:
                p_excl = torch.zeros(0)
            cpa, _ = _timed("cocktail-party", obs, preset="quick")
            p_cpa = _scores(cpa.images.clamp(lo, hi), x)
            rows.append((label, f"{arch} ({acc:.0%})", batch, batches,
                         "/".join(str(c[4]) for c in counts), _rate(exact, n), cert, false,
                         max(c[3] for c in counts),
                         f"{int((p_excl > 60).sum())}/{batch}",
                         f"{int((p_cpa > 60).sum())}/{batch} ({float(p_cpa.median()):.1f})",
                         f"{int((grey_p > 60).sum())}/{n} ({float(grey_p.median()):.1f})",
                         f"{int((rand_p > 60).sum())}/{n} ({float(rand_p.median()):.1f})"))
    table("large B: exact samples (> 60 dB, matched) on ReLU MLPs (untrained, undefended)",
          ["data", "model (accuracy)", "B", "batches", "rank ∂W", "spear exact [95 % Wilson]", "certified",
           "false cert.", "spear s (max)", "exclusivity exact (1st)", "cocktail-party exact (median dB, 1st)",
           "grey exact (median dB)", "random non-members exact (median dB)"], rows,
          note="batches: seeded permutations of the pool (np.random.default_rng([B, k]), k = 0, 1, …); n = batches × B "
               "samples (not independent: the interval is indicative); false cert.: certified yet more than 1e-4 "
               "off (max-abs); chance rows matched one-to-one like the reconstructions; accuracy of the untrained "
               "model on the whole dataset; seconds on a shared 2-core machine")


#: (defense, what it tests) of the federated rows; the quick run keeps the first three
FEDERATED = (("local:1,0.1", "one local step (a scaled gradient)"), ("local:5,0.1", "5 full-batch steps"),
             ("local:2,0.1,8", "2 epochs of minibatches of 8"), ("local:20,0.1", "20 full-batch steps"),
             ("local:5,0.1+clip:0.01", "5 steps, then the update clipped"),
             ("local:5,0.1+noise:1e-6", "5 steps, then Gaussian noise"))


def _trained_mlp(data, train_idx, seed: int = 0, arch: str = "mlp:1000"):
    from leakbench.evaluation.training.utility import train_model

    model = lb.build(arch, input_shape=data.shape, classes=10, seed=seed)
    return train_model(model, data.subset(list(train_idx)), epochs=3, batch_size=32, lr=0.05, seed=seed).model.eval()


def _why(text: str) -> str:
    """A short name for spear's ``trace["uncertified"]`` (the table's last column)."""
    for key, short in (("minibatch", "minibatch slots unknown"), ("misfits", "replay misfits"),
                       ("less precise", "some samples imprecise"), ("factorisation gave", "rank below B")):
        if key in text:
            return short
    return text


def federated(quick: bool) -> None:
    """spear on FedAvg updates: several local steps certified by replaying them, minibatch epochs and noise refused."""
    from leakbench.attacks.solvers.local_replay import REPLAY_TOL
    from leakbench.attacks.solvers.local_replay import replay_misfit

    data = lb.load("digits", size=28, deform=1.0, seed=1)
    train_idx, pool = range(0, 1000), np.arange(1000, len(data))
    batch, count = 32, 1 if quick else 2
    models = [("untrained", lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=0).eval())]
    if not quick:
        models.append(("trained 3 epochs", _trained_mlp(data, train_idx)))
    settings = FEDERATED[:3] if quick else FEDERATED
    rows = []
    for label, model in models:
        with torch.no_grad():
            acc = float((model(data.images[pool]).argmax(1) == data.labels[pool]).float().mean())
        for defense, what in settings:
            exact = cert = false = 0
            misfits, controls, grey, seconds, why = [], [], [], 0.0, set()
            for k in range(count):
                order = np.random.default_rng([batch, k, 7]).permutation(pool)
                x, y = data.batch(indices=order[:batch])
                obs = lb.observe(model, x, y, defense=defense, seed=k)
                rec, sec = _timed("spear", obs)
                seconds = max(seconds, sec)
                e, c, f, _, _ = _spear_counts(obs, x)
                exact, cert, false = exact + e, cert + c, false + f
                if "replay_misfit" in rec.trace:
                    misfits.append(rec.trace["replay_misfit"])
                if "uncertified" in rec.trace:
                    why.add(_why(rec.trace["uncertified"]))
                if not obs.local_batches and rec.labels is not None:
                    # the control: the recovered batch with its first sample swapped for a non-member
                    swapped = rec.images.clone()
                    swapped[0] = data.images[int(order[batch])]
                    controls.append(replay_misfit(obs, swapped.reshape(batch, -1), rec.labels)[0])
                grey.append(_scores(torch.full_like(x, 0.5), x))
            n = batch * count
            grey_p = torch.cat(grey)
            rows.append((f"{label} ({acc:.2f})", defense, what, _rate(exact, n), cert, false,
                         f"{max(misfits):.1e}" if misfits else "—", f"{min(controls):.1e}" if controls else "—",
                         f"{int((grey_p > 60).sum())}/{n} ({float(grey_p.median()):.1f})", seconds,
                         "; ".join(sorted(why)) or "—"))
    table(f"spear on FedAvg updates: digits-like 28×28 (deform=1), B = {batch}, mlp:1000", [
        "model (held-out acc.)", "defense", "what", "exact [95 % Wilson]", "certified", "false cert.",
        "replay misfit (max)", "control: one non-member swapped in (min)", "grey exact (median dB)", "spear s (max)",
        "uncertified because"], rows,
        note=f"n = {count} × {batch} samples per row (batches: seeded permutations of digits 1000…, trained model fit "
             f"on digits 0–999); certificate: replay misfit ≤ {REPLAY_TOL:g} and SPEAR's precision estimate ≤ 1e-4/3 of "
             "the range (LOCAL_HEADROOM); one-step updates: peeling with the update's storage floor; false cert.: certified yet more than 1e-4 off (max-abs); the control swaps one recovered "
             "sample for a non-member and replays: above the threshold, a wrong batch is not certified")


def _trained_cifar() -> list[tuple]:
    """Rows of :func:`trained_next_layer` for an ``mlp:2000`` trained on the CIFAR-10 images with index mod 100 < 50
    (the file is sorted by class), B = 256 on two batches of the others; none without the file."""
    if not CIFAR_NPZ.exists():
        return []
    from leakbench.data.cifar import CIFAR10_CLASSES

    rows = []
    data = lb.load("npz", path=str(CIFAR_NPZ), classes=list(CIFAR10_CLASSES))
    index = np.arange(len(data))
    train, held = index[index % 100 < 50], index[index % 100 >= 50]
    model = _trained_mlp(data, train, arch="mlp:2000")
    with torch.no_grad():
        acc = float((model(data.images[held]).argmax(1) == data.labels[held]).float().mean())
    for k in range(2):
        x, y = data.batch(indices=np.random.default_rng([256, k, 7]).permutation(held)[:256])
        obs = lb.observe(model, x, y)
        grey = _scores(torch.full_like(x, sum(obs.data_range) / 2), x)
        rec, seconds = _timed("spear", obs)
        _, err, cert = _matched(rec, x)
        rows.append((f"CIFAR-10 mlp:2000 ({acc:.3f})", 256, k, "on", f"{int((err < 1e-4).sum())}/256",
                     int(cert.sum()), int((cert & (err > 1e-4)).sum()), seconds, f"{int((grey > 60).sum())}/256"))
    return rows


def trained_next_layer() -> None:
    """B = 64 and 128 on a trained ``mlp:1000`` and B = 256 on a trained ``mlp:2000`` (digits-like 0–999, 3 epochs),
    held-out batches from digits 1000 on, ``spear`` with and without the next layer's directions, beside the grey
    image; and B = 256 on an ``mlp:2000`` trained on half the CIFAR-10 images (when the file is there)."""
    data = lb.load("digits", size=28, deform=1.0, seed=1)
    rows = []
    for arch, batches in (("mlp:1000", (64, 128)), ("mlp:2000", (256,))):
        model = _trained_mlp(data, range(1000), arch=arch)
        with torch.no_grad():
            acc = float((model(data.images[1000:]).argmax(1) == data.labels[1000:]).float().mean())
        for batch in batches:
            for k in range(2):
                order = np.random.default_rng([batch, k, 7]).permutation(np.arange(1000, len(data)))
                x, y = data.batch(indices=order[:batch])
                obs = lb.observe(model, x, y)
                grey = _scores(torch.full_like(x, sum(obs.data_range) / 2), x)
                for flag in (True, False):
                    rec, seconds = _timed("spear", obs, next_layer=flag)
                    _, err, cert = _matched(rec, x)
                    rows.append((f"{arch} ({acc:.3f})", batch, k, "on" if flag else "off",
                                 f"{int((err < 1e-4).sum())}/{batch}", int(cert.sum()), int((cert & (err > 1e-4)).sum()),
                                 seconds, f"{int((grey > 60).sum())}/{batch}"))
    rows += _trained_cifar()
    table("spear on trained MLPs (held-out accuracy), digits-like 28×28 (and CIFAR-10), with and without next_layer",
          ["model (accuracy)", "B", "batch", "next_layer", "exact (1e-4)", "certified", "false cert.", "s",
           "grey exact"], rows)


def run(quick: bool = False) -> None:
    digits(quick)
    cifar(quick)
    defended(quick)
    federated(quick)
    if not quick:
        large()
        trained_next_layer()
