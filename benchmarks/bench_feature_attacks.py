"""Feature-level and malicious-server attacks against Inverting Gradients, by batch size.

The shape of Liu et al. (2024)'s Tables 3/4/6 at a CPU budget: CIFAR-10 test images (32×32) on
the ConvNet of Geiping et al. (width 8, BN in training mode with the statistics granted, as in
Liu et al. Sec. 5.1), batch sizes 1, 4, 8, 16.  Every attack runs in this process on the same
batch:

* ``inverting-gradients`` and ``liu2024`` (and its ablation without the feature term) on the model
  shipped with Liu et al.'s partly random head (App. F), its input centred by the mean feature of
  200 public images outside the batch (``random_head(center="calibration")``, a documented
  departure: the features of an untrained ConvNet are nearly collinear) — the same observation,
  the same iteration budget;
* ``tensor-features`` on that observation: the feature reconstruction error (Liu et al. Table 2);
* ``cocktail-party`` on the same observation (its first linear layer is the head: needs B ≤ 10);
* ``robbing-the-fed`` on the model shipped behind an imprint block of 128 bins (its own server
  modification), with the fraction of the batch recovered exactly and ``imprint_expected``.

RMSE/PSNR/SSIM after Hungarian matching, and wall seconds per attack.
"""
from __future__ import annotations

import time

import torch
from scipy.optimize import linear_sum_assignment

import leakbench as lb
from leakbench.analysis import imprint_expected
from leakbench.attacks.gradient.tensor_features import block_input, find_block
from leakbench.metrics import feature_error
from leakbench.models.malicious import imprint, random_head

from .common import benchmark_images, public_images, table

BATCHES = (1, 4, 8, 16)


def _score(rec, x) -> tuple[float, float, float]:
    s = lb.compare(rec, x)
    return s["rmse"], s["psnr"], s["ssim"]


def _timed(name, obs, **options):
    start = time.perf_counter()
    rec = lb.attack(name, obs, **options)
    return rec, time.perf_counter() - start



def run(quick: bool = False) -> None:
    ds, source = benchmark_images(64)
    iterations = 100 if quick else 500
    width = 20_000
    rows, feature_rows = [], []
    for batch in BATCHES:
        x, y = ds.batch(batch, seed=batch)
        model = lb.build("convnet-8", input_shape=ds.shape, classes=ds.num_classes, seed=0)
        shipped = random_head(model, width=width, seed=0, center="calibration", calibration=public_images(ds, x, 200))
        obs = lb.observe(shipped, x, y, labels_known=True, train=True, bn_stats=True)
        runs = [("inverting-gradients", dict(preset="quick", iterations=iterations)),
                ("liu2024", dict(preset="quick", iterations=iterations)),
                ("liu2024 w/o feature term", dict(preset="quick", iterations=iterations, feature=0.0))]
        for label, options in runs:
            rec, secs = _timed(label.split()[0], obs, **options)
            rows.append((batch, label, *_score(rec, x), secs))
        if batch <= 10:
            rec, secs = _timed("cocktail-party", obs, preset="quick")
            rows.append((batch, "cocktail-party (head layer)", *_score(rec, x), secs))
        else:
            rows.append((batch, "cocktail-party (head layer)", "n/a: B > 10 outputs", "", "", ""))
        rec, secs = _timed("tensor-features", obs, inversion_iterations=0)
        module = find_block(obs.model).feature_module      # input of the random layer: z − μ
        z = block_input(obs.model, module, x).detach()
        other, _ = ds.batch(batch, seed=100 + batch)
        z_other = block_input(obs.model, module, other).detach()
        unit = torch.nn.functional.normalize(z.double(), dim=1)
        cos = rec.trace["features"].double() @ unit.T
        rows_, cols_ = linear_sum_assignment(-cos.abs().numpy())
        signed = cos[rows_, cols_]
        feature_rows.append((batch, feature_error(rec.trace["features"], z), feature_error(z_other, z),
                             float(signed.mean()), f"{int((signed > 0).sum())}/{batch}", secs))

        imprinted = imprint(model, bins=128, seed=0, calibration=ds.images[-200:])
        obs_rtf = lb.observe(imprinted, x, y)
        rec, secs = _timed("robbing-the-fed", obs_rtf)
        flat_r, flat_x = rec.images.reshape(rec.batch_size, -1), x.reshape(batch, -1)
        rel = (flat_r[None] - flat_x[:, None]).norm(dim=-1) / flat_x.norm(dim=-1)[:, None]
        exact = int((rel.min(dim=1).values < 1e-4).sum())
        rows.append((batch, f"robbing-the-fed (128 bins; exact {exact}/{batch}, "
                            f"expected {imprint_expected(128, batch):.2f})", *_score(rec, x), secs))
    note = (f"{source}; convnet-8 (BN, training mode, statistics granted) + random head of {width} neurons "
            "(input centred on 200 public images); "
            f"{iterations} iterations for the optimisation attacks (preset quick: U-Net width 16, depth 2); "
            f"labels known; one batch per size; threads={torch.get_num_threads()}")
    table("Feature-level attacks vs Inverting Gradients — reconstruction by batch size",
          ["batch", "attack", "RMSE ↓", "PSNR ↑", "SSIM ↑", "seconds"], rows, note=note)
    table("Tensor method — feature reconstruction error (Liu et al. Table 2)",
          ["batch", "feature error", "another batch's features (baseline)", "matched cosine", "signs right",
           "seconds"], feature_rows,
          note=f"centred penultimate features of convnet-8 (288 dims), {width} random neurons; error = mean "
               "‖P⊥ z_i/‖z_i‖‖; matched cosine = mean signed cosine after Hungarian matching on |cos|")
