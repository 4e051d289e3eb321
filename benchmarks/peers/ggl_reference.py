"""Run the GGL authors' code (Li et al., CVPR 2022) on a model, a generator and one image given as files.

Started by ``benchmarks/bench_peers_ggl.py`` with the Python of an environment that imports the reference's
requirements (torch, torchvision, nevergrad, gpytorch, lpips, pandas, matplotlib, tqdm, pytorch-pretrained-biggan:
``LEAKBENCH_GGL_PYTHON``), never imported by leakbench.  ``--repo`` is a checkout of
https://github.com/zhuohangli/GGL (commit c555338 measured)::

    python ggl_reference.py --repo REPO --model model.pt --generator decoder.pt --data data.npz --out out.npz

``model.pt`` and ``decoder.pt`` are TorchScript modules: the attacked classifier (images in [0, 1]) and the
generator (codes n × latent ↦ images in [0, 1]).  ``data.npz`` holds one image ``x`` (1 × C × H × W), its label
``y`` and ``latent``.  The attack is the ``NGReconstructor`` of the reference's unconditional-generator script
(``celeba32_wgan-gp.py``, its WGAN-GP set-up: the repository's ``reconstructor.py`` is the class-conditional BigGAN
one), with that script's arguments: nevergrad's ``CMA`` from z = 0, ``use_tanh=False`` (so its KL term, weight
0.1), the squared ℓ2 distance over layers divided by their number, the label inferred from the last layer's weight
gradient (iDLG), no defense, one trial.  ``--rounds`` is its ``budget``: rounds of 50 candidates each.

The one adaptation, of the harness and not of the algorithm: the script parses its command line when imported, so
it is imported with an empty one (its own defaults), and its ``run_exp`` (CelebA files, LPIPS weights) is not run.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
import time
from pathlib import Path

import numpy as np
import torch

SCRIPT = "celeba32_wgan-gp.py"


def load_script(repo: str):
    """The reference's unconditional-generator script as a module (its argument parser given no arguments)."""
    sys.path.insert(0, repo)
    spec = importlib.util.spec_from_file_location("ggl_celeba32", str(Path(repo) / SCRIPT))
    module = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, [SCRIPT]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv
    return module


def main() -> None:
    from _cli import parse

    args = parse(__doc__.splitlines()[0], ("model", "generator", "data"), rounds=40)
    script = load_script(args.repo)
    from inversefed.data.loss import Classification

    data = np.load(args.data, allow_pickle=False)
    x, y = torch.from_numpy(data["x"]).float(), torch.from_numpy(data["y"]).long()
    latent = int(data["latent"])
    model = torch.jit.load(args.model).eval()
    gen = torch.jit.load(args.generator).eval()
    loss_fn = Classification()
    target, _, _ = loss_fn(model(x), y)
    grads = [g.detach() for g in torch.autograd.grad(target, list(model.parameters()))]
    classes = int(grads[-1].numel())
    machine = script.NGReconstructor(fl_model=model, generator=gen, loss_fn=loss_fn, num_classes=classes,
                                     search_dim=(latent,), strategy="CMA", budget=args.rounds, use_tanh=False,
                                     defense_setting=None)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):      # a line per round
        z, images, _, loss = machine.reconstruct(grads, use_pbar=False)
    seconds = time.perf_counter() - start
    label = int(machine.infer_label(grads)[0])
    np.savez(args.out, final=images.detach().clamp(0, 1).numpy(), seconds=np.asarray(seconds),
             loss=np.asarray(float(loss)), label=np.asarray(label))


if __name__ == "__main__":
    main()
