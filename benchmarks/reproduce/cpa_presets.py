"""Cocktail Party Attack (Kariyappa et al., ICML 2023): our ``default`` against the ``paper`` preset, with and
without the paper's TV term, on held-out batches.

The paper's objective (its eq. in the ablation appendix) is −J(v G) + λ_TV·TV(v G) + λ_MI·E exp(T·|CS|),
and its ablation (FC-2 on Tiny-ImageNet, B = 32) ranks the terms: LPIPS 0.081 with all three, 0.092
without negentropy, 0.368 without TV, 0.546 without the decorrelation term.  The CPA paper is not in
../shared/papers: these values are quoted from arXiv 2209.05578 (appendix "Ablation Study", its table).

Rows: ``default`` (our edge-domain ICA, no TV), ``paper`` (pixel domain + TV, λ_TV = 10), ``paper
without TV`` (the ``paper`` preset before this entry existed), and the controls: the grey image and the
``paper`` preset on a noise gradient.  Default: ``mlp:1000`` (float32, seed 0), B = 4, 8, 16, one
held-out batch each; ``--full``: also ``mlp:256`` and B = 32.
"""
from __future__ import annotations

import leakbench as lb

from .common import Quote, grey, held_out_images, noise_observation, paper_vs_ours, score

QUOTE = Quote("Kariyappa et al. 2023, arXiv 2209.05578", "appendix Ablation Study, LPIPS table", stored=False)
PAPER_ABLATION = {"NE+TV+MI": 0.081, "-NE": 0.092, "-TV": 0.368, "-MI": 0.546}
CONFIGS = {"default": {}, "paper": {"preset": "paper"}, "paper without TV": {"preset": "paper", "tv": 0.0}}


def one(spec: str, batch: int, *, configs=CONFIGS, seed: int = 0, **extra) -> dict:
    ds, idx, source = held_out_images(batch)
    x, y = ds.batch(indices=idx)
    obs = lb.observe(lb.build(spec, input_shape=ds.shape, classes=ds.num_classes, seed=seed), x, y)
    psnr = {label: score(lb.attack("cocktail-party", obs, seed=seed, **o, **extra).images, x)["psnr"]
            for label, o in configs.items()}
    psnr["grey image"] = grey(x)["psnr"]
    noisy = lb.attack("cocktail-party", noise_observation(obs, seed=seed), preset="paper", seed=seed, **extra)
    psnr["paper on noise gradient"] = score(noisy.images, x)["psnr"]
    return {"model": spec, "B": batch, "psnr": psnr, "source": source}


def rows(*, full: bool = False, only: list[tuple[str, int]] | None = None) -> list[dict]:
    plan = only or [(m, b) for m in (["mlp:1000", "mlp:256"] if full else ["mlp:1000"])
                    for b in ([4, 8, 16, 32] if full else [4, 8, 16])]
    return [one(m, b) for m, b in plan]


def run(full: bool = False, only=None) -> None:
    out = rows(full=full, only=only)
    labels = list(out[0]["psnr"])
    paper_vs_ours("Cocktail Party presets — PSNR (dB) on held-out batches; the paper's TV term is what the old "
                  "paper preset lacked", ["model", "B", *labels],
                  [(r["model"], r["B"], *[r["psnr"][k] for k in labels]) for r in out], quote=QUOTE,
                  note=f"{out[0]['source']}; PSNR after Hungarian matching; the paper's ablation (LPIPS, lower is "
                       f"better): {', '.join(f'{k} {v}' for k, v in PAPER_ABLATION.items())}")
