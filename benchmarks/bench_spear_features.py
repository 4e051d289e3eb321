"""``spear-features``: exact batches inside a ConvNet — the features at a hidden ReLU FC layer, then the images.

Issue 46, part 2.  The model is a ConvNet with such a layer: Conv2d(C → 16, 3×3, padding 1) → ReLU → Flatten →
Linear(16·H·W → 1024) → ReLU → Linear(1024 → 10), built from seed 0, untrained or trained (SGD, 5 epochs, lr 0.05,
batch 32) on a disjoint training split; its accuracy on held-out images is printed with every row.  Data: digits at
16×16 (train 0–999, attacked 1 000+) and, when ../shared/data/cifar10-test-1000.npz is present, CIFAR-10 test
images at 2×2-averaged 16×16 (the file is sorted by class: train on the even indices, attack the odd ones).  Attacked: undefended one-step gradients of ``n`` disjoint seeded
batches per B; labels not granted.

Per row, after the library's one-to-one matching: samples exact (max-abs error ≤ 1e-4 of the data range) with a
Clopper–Pearson 95 % interval, certified, certified wrongly, median PSNR, seconds per batch.  Chance in the same
metric: the grey image at the batch's mean and B random images of the attacked pool that are not in the batch
(random non-members), matched the same way.  ``--quick``: B = 32, one batch, digits untrained only.
``LEAKBENCH_SF_B=32,64,128`` the batch sizes, ``LEAKBENCH_SF_N=2`` batches per size.
"""
from __future__ import annotations

import time

import torch
from torch import nn

import leakbench as lb
from leakbench.evaluation.training.utility import loss_and_accuracy, train_model
from leakbench.evaluation.verdicts.stats import binomial

from .common import CIFAR_NPZ, console, env_names, table

EXACT = 1e-4


def model_for(shape: tuple[int, ...], classes: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    c, h, w = shape
    return nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * h * w, 1024),
                         nn.ReLU(), nn.Linear(1024, classes))


def _exact_and_psnr(images: torch.Tensor, x: torch.Tensor, order: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, float]:
    """Per original, the max-abs error of its matched reconstruction, and the median PSNR; ``order`` is the
    attack's own matching (``lb.compare``'s, certified slots first), else the library's one-to-one matching."""
    if order is None:
        order = lb.metrics.match(images.detach().cpu().clamp(0, 1), x)
    rec = images.detach().cpu().double()[order]
    err = (rec.reshape(len(x), -1) - x.double().reshape(len(x), -1)).abs().amax(1)
    return err, float(lb.metrics.psnr(rec.clamp(0, 1).to(x.dtype), x).median())


def _interval(k: int, n: int) -> str:
    ci = binomial(k, n)
    return f"{k}/{n} [{100 * ci.low:.1f}, {100 * ci.high:.1f}] %"


def run(*, quick: bool = False) -> None:
    sizes = [32] if quick else [int(b) for b in (env_names("LEAKBENCH_SF_B") or ["32", "64", "128"])]
    count = 1 if quick else int((env_names("LEAKBENCH_SF_N") or ["2"])[0])
    sets = [("digits 16×16", lb.load("digits", size=16), range(0, 1000), range(1000, 1797))]
    if CIFAR_NPZ.exists() and not quick:
        from leakbench.data.cifar import CIFAR10_CLASSES

        full = lb.load("npz", path=str(CIFAR_NPZ), classes=list(CIFAR10_CLASSES))
        # 2×2 means to 16×16: the convolution's least squares per sample is then (live rows ≈ 2 048) × 768
        cifar = lb.ImageDataset(torch.nn.functional.avg_pool2d(full.images, 2), full.labels, full.classes, "cifar16")
        # the file is sorted by class: train on the even indices, attack the odd ones (every class in both)
        sets.append(("CIFAR-10 16×16", cifar, range(0, 1000, 2), range(1, 1000, 2)))
    rows = []
    start = time.perf_counter()
    for label, ds, train, pool in sets:
        for trained in ([False] if quick else [False, True]):
            model = model_for(ds.shape, ds.num_classes)
            if trained:
                model = train_model(model, ds.subset(list(train)), epochs=5, batch_size=32, lr=0.05, seed=0).model
            model.eval()
            held = list(pool)
            _, acc = loss_and_accuracy(model, ds.images[held], ds.labels[held])
            for B in sizes:
                order = torch.randperm(len(held), generator=torch.Generator().manual_seed(B)).tolist()
                if B * (count + 1) > len(held):
                    raise SystemExit(f"{count} batches of {B} and their non-member controls need {B * (count + 1)} "
                                     f"images; {label}'s pool holds {len(held)}")
                tally = {"exact": 0, "cert": 0, "wrong": 0, "grey": 0, "other": 0}
                psnrs, greys, others, secs = [], [], [], []
                for b in range(count):
                    idx = [held[i] for i in order[b * B:(b + 1) * B]]
                    non = [held[i] for i in order[count * B:(count + 1) * B]]   # never in any attacked batch
                    x, y = ds.batch(indices=idx)
                    t0 = time.perf_counter()
                    rec = lb.attack("spear-features", lb.observe(model, x, y))
                    secs.append(time.perf_counter() - t0)
                    order_rec = torch.tensor(lb.compare(rec, x)["order"])
                    err, p = _exact_and_psnr(rec.images, x, order_rec)   # the same matching for error and certificate
                    cert = rec.confidence.bool()[order_rec]
                    tally["exact"] += int((err <= EXACT).sum())
                    tally["cert"] += int(cert.sum())
                    tally["wrong"] += int((cert & (err > EXACT)).sum())
                    psnrs.append(p)
                    g_err, g = _exact_and_psnr(torch.full_like(x, float(x.mean())), x)
                    o_err, o = _exact_and_psnr(ds.batch(indices=non)[0], x)
                    tally["grey"] += int((g_err <= EXACT).sum())
                    tally["other"] += int((o_err <= EXACT).sum())
                    greys.append(g)
                    others.append(o)
                n = B * count
                row = [label, "trained" if trained else "untrained", f"{acc:.3f}", B, _interval(tally["exact"], n),
                       tally["cert"], tally["wrong"], f"{sorted(psnrs)[len(psnrs) // 2]:.1f}",
                       f"{tally['grey']}/{n} ({sorted(greys)[len(greys) // 2]:.1f} dB)",
                       f"{tally['other']}/{n} ({sorted(others)[len(others) // 2]:.1f} dB)",
                       " / ".join(f"{s:.0f}" for s in secs)]
                rows.append(row)
                console.print(f"[dim]{' | '.join(map(str, row))} ({time.perf_counter() - start:.0f} s)[/dim]",
                              highlight=False)
    table("spear-features: exact images from a ConvNet's hidden ReLU FC layer (one undefended step, labels unknown)",
          ["data", "model", "held-out acc.", "B", "exact (95 % CI)", "certified", "false cert.", "PSNR median",
           "grey: exact (PSNR)", "random non-members: exact (PSNR)", "s per batch"], rows,
          f"Conv(C→16) ReLU → FC 1024 ReLU → FC 10, seed 0; {count} batch(es) per B, n = B × batches; exact = max-abs "
          f"error ≤ {EXACT:g} after matching; {time.perf_counter() - start:.0f} s on {torch.get_num_threads()} "
          "thread(s); a 10-class model's chance accuracy is 0.10.")
