"""Pan et al. (USENIX Security 2022): the fraction of a batch reconstructable through neuron exclusivity, against B.

Claim (the proofs appendix in ../shared/papers, Proposition 2): a sample with ≥ 2 exclusively activated
neurons (ExANs) in the last hidden layer and ≥ 1 in every other hidden layer is recovered exactly from the
batch gradient of a ReLU MLP; Theorem 2: otherwise the perturbations leaving the gradient unchanged form a
space of dimension (d0 − rank W0)(M − rank A) — the batch is not determined.  The stored text holds the
proofs only: the main paper's curves (fraction vs batch size) are not in ../shared/papers, so the
"paper" column here is the prediction of Proposition 2 computed on the same batch
(:func:`leakbench.analysis.exclusivity`): the attack must recover at least those samples, and every
sample it flags unique should be exact (the "attack: unique" and "recovered" columns side by side).

Ours: ``exclusivity`` on ReLU MLPs (CIFAR-10 held-out images, float64, untrained, seed 0) at
B = 1 … 64; "recovered" = samples reconstructed at PSNR ≥ 40 dB (exact up to round-off gives > 100 dB).
Controls: the grey image; the attack on a noise gradient (same norm per tensor) — it must recover nothing.
Default: ``mlp:1000`` at B = 1, 2, 4, 8, 16, 32, 64.  ``--full``: also ``mlp:1000-1000`` and B = 128.
"""
from __future__ import annotations

import torch

import leakbench as lb
from leakbench.analysis import exclusivity
from leakbench.errors import NothingRecovered

from .common import Quote, grey, held_out_images, noise_observation, paper_vs_ours

QUOTE = Quote("pan2022-neuron-exclusivity-proofs.txt", "Proposition 2 and Theorem 2 (proofs appendix, Sec. I–II)")
EXACT_DB = 40.0


def one(spec: str, batch: int, *, seed: int = 0) -> dict:
    ds, idx, source = held_out_images(batch)
    x, y = ds.batch(indices=idx)
    model = lb.build(spec, input_shape=ds.shape, classes=ds.num_classes, seed=seed, dtype=torch.float64)
    x64 = x.double()
    report = exclusivity(model, x64, y, directions=0, lp_steps=0)
    obs = lb.observe(model, x64, y)
    rec = lb.attack("exclusivity", obs)
    psnr = _psnr_each(rec.images, x)
    try:
        noise = lb.attack("exclusivity", noise_observation(obs, seed=seed))
        noise_psnr = _psnr_each(noise.images, x)
    except NothingRecovered:  # the control determines nothing: no image, so no exact sample
        noise_psnr = torch.zeros(0)
    return {"model": spec, "B": batch, "predicted": report.reconstructable_count,
            "unique": int(sum(rec.trace["unique"])), "recovered": int((psnr >= EXACT_DB).sum()),
            "psnr": float(psnr.mean()), "grey": grey(x)["psnr"],
            "noise_recovered": int((noise_psnr >= EXACT_DB).sum()), "theorem2_dim": report.theorem2_dim,
            "source": source}


def _psnr_each(images: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """PSNR of each original against its matched reconstruction (Hungarian on MSE)."""
    return torch.as_tensor(lb.compare(images.float().clamp(0, 1), x.float(), match=True)["per_sample"]["psnr"])


def rows(*, full: bool = False, only: list[tuple[str, int]] | None = None) -> list[dict]:
    batches = [1, 2, 4, 8, 16, 32, 64] + ([128] if full else [])
    plan = only or [(spec, b) for spec in (["mlp:1000", "mlp:1000-1000"] if full else ["mlp:1000"]) for b in batches]
    return [one(spec, b) for spec, b in plan]


def run(full: bool = False, only=None) -> None:
    out = rows(full=full, only=only)
    paper_vs_ours("Pan et al. — samples reconstructable through neuron exclusivity, against batch size",
                  ["model", "B", "Prop. 2 predicts", "attack: unique", "recovered ≥ 40 dB", "fraction",
                   "mean PSNR", "grey PSNR", "noise gradient: recovered", "Thm 2 dim"],
                  [(r["model"], r["B"], r["predicted"], r["unique"], r["recovered"], r["recovered"] / r["B"],
                    r["psnr"], r["grey"], r["noise_recovered"], r["theorem2_dim"]) for r in out],
                  quote=QUOTE, note=f"{out[0]['source']}; float64, untrained ReLU MLP (seed 0), CE loss, labels "
                                    "recovered by the attack; PSNR after Hungarian matching")
