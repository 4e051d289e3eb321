"""Run the GIFD authors' code (Fang et al., ICCV 2023) on a model, a generator in stages and one image given as files.

Started by ``benchmarks/bench_peers_gifd.py`` with the Python of an environment that imports the reference's
requirements (torch, torchvision, nevergrad, FrEIA, …: ``LEAKBENCH_GIFD_PYTHON``), never imported by leakbench.
``--repo`` is a checkout of https://github.com/ffhibnese/GIFD_Gradient_Inversion_Attack (commit ff243fe measured);
its package ``inversefed`` is imported from there::

    python gifd_reference.py --repo REPO --model model.pt --stages stage0.pt,stage1.pt,… --data data.npz --out out.npz

``model.pt`` is the attacked classifier (images in [0, 1]) and ``stage*.pt`` the generator's stages G_1 … G_N
(codes ↦ … ↦ images in [0, 1]), all TorchScript.  ``data.npz`` holds one image ``x``, its label ``y``, ``latent``
and ``radii`` (one ℓ1 radius per feature space).  The attack is the reference's ``GradientReconstructor`` with
``gifd=True`` on its BigGAN branch, with ``configs_biggan.yml``'s options (cosine cost ``sim_cmpr0``, Adam at lr 0.1
in every space with its ramped schedule, TV 1e-4, image norm 1e-6, the latent kept on its sphere, every feature
projected onto the ℓ1 ball around its start), the step counts and radii given here; the label inferred from the
gradient (iDLG).  The result is its ``Best_first_N_layer`` entry: the best-scoring space.

Adaptations, of the harness and not of the algorithm:

* the generator is wrapped in the interface of the reference's layer-wise BigGAN (``G(h, ys, truncation)`` ↦
  (output, ys), with ``start_layer`` / ``end_layer``): its layers are G_1 … G_N, and after the last the image is
  mapped from [0, 1] to BigGAN's [−1, 1] (the reference searches the outputs of all layers but the last, so the
  features of G_1 … G_{N−1}, as leakbench does); the class vector ``ys`` passes through unused
  (the generator is unconditional); a feature it hands back is a tensor of its own, not a view (the reference
  optimises it in place; a stage ending in a reshape would hand back a view);
* the reference draws BigGAN's 128-entry codes; the wrapper feeds their first ``latent`` entries to G_1 (the
  others only see the sphere projection);
* the reference's radii are absolute per layer (BigGAN's); here each is leakbench's relative ``radius`` times the
  mean ℓ1 norm of that feature over random codes z ~ N(0, I), computed by the caller.

Seen in the reference and left as is: ``choose_optimal`` scores every restart but returns the *last* restart's image
(``x[trial]`` after its loop), so with several restarts its result is one restart's, not the best one's.
"""
from __future__ import annotations

import contextlib
import io
import time

import numpy as np
import torch


class StagedBigGAN(torch.nn.Module):
    """Generator stages behind the reference's layer-wise BigGAN interface."""

    def __init__(self, stages: list[torch.nn.Module], latent: int) -> None:
        super().__init__()
        self.layers, self.latent = torch.nn.ModuleList(stages), latent
        self.start_layer, self.end_layer = 0, len(self.layers)

    def forward(self, h: torch.Tensor, ys: torch.Tensor, truncation: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self.start_layer == 0:
            h = h.flatten(1)[:, : self.latent]
        for layer in self.layers[self.start_layer:self.end_layer]:
            h = layer(h)
        if self.end_layer == len(self.layers):
            return 2 * h - 1, ys
        return h.clone(), ys        # not a view: the reference optimises this feature in place


def config(latent_steps: int, feature_steps: int, restarts: int, radii: list[float]) -> dict:
    """The reference's options (configs_biggan.yml) with these step counts and radii."""
    spaces = len(radii) + 1
    return dict(signed=False, cost_fn="sim_cmpr0", indices="def", weights="equal", lr=0.03, optim="adam",
                restarts=restarts, max_iterations=latent_steps, total_variation=1e-4, bn_stat=0, image_norm=1e-6,
                z_norm=0, group_lazy=0, init="randn", lr_decay=True, dataset="CIFAR10", generative_model="BigGAN",
                gen_dataset="ImageNet64", gifd=True, gias=False, ggl=False,
                steps=[latent_steps] + [feature_steps] * (spaces - 1), lr_io=[0.1] * spaces, start_layer=0,
                end_layer=spaces, project=True, do_project_gen_out=True, do_project_noises=False,
                do_project_latent=False, max_radius_gen_out=[-1.0, *radii], max_radius_noises=[-1] * spaces,
                max_radius_latent=[-1] * spaces)


def main() -> None:
    from _cli import parse

    args = parse(__doc__.splitlines()[0], ("model", "stages", "data"), latent_steps=200, feature_steps=70,
                 restarts=2)
    from inversefed.reconstruction_algorithms import GradientReconstructor

    data = np.load(args.data, allow_pickle=False)
    x, y = torch.from_numpy(data["x"]).float(), torch.from_numpy(data["y"]).long()
    radii = [float(r) for r in data["radii"]]
    model = torch.jit.load(args.model).eval()
    stages = [torch.jit.load(p).eval() for p in args.stages.split(",")]
    gen = StagedBigGAN(stages, int(data["latent"])).requires_grad_(False)   # only codes and features are searched
    grads = [g.detach() for g in torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y),
                                                     list(model.parameters()))]
    c = x.shape[1]
    mean_std = (torch.zeros(c, 1, 1), torch.ones(c, 1, 1))   # the model takes images in [0, 1]
    options = config(args.latent_steps, args.feature_steps, args.restarts, radii)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # per-step bars
        machine = GradientReconstructor(model, "cpu", mean_std, options, num_images=len(y), G=gen)
        start = time.perf_counter()
        results = machine.reconstruct(grads, y, img_shape=tuple(x.shape[1:]))
        seconds = time.perf_counter() - start
    _, images, stats = [r for r in results if r[0].startswith("Best_")][-1]      # the best over every space
    name = min((r for r in results if r[0].startswith("layer")), key=lambda r: r[2]["opt"])[0]
    label = int(machine.infer_label(grads, num_inputs=len(y))[0])
    np.savez(args.out, final=images.detach().clamp(0, 1).numpy(), seconds=np.asarray(seconds),
             score=np.asarray(float(stats["opt"])), label=np.asarray(label), layer=np.asarray(name))


if __name__ == "__main__":
    main()
