"""Run the GIAS authors' code (Jeon et al., NeurIPS 2021) on a model, a generator and images given as files.

Started by ``benchmarks/bench_peers_gias.py`` with the Python of an environment that imports torch and torchvision
(``LEAKBENCH_GIAS_PYTHON``), never imported by leakbench.  ``--repo`` is a checkout of
https://github.com/ml-postech/gradient-inversion-generative-image-prior (commit f841412 measured); its package
``inversefed`` is imported from there::

    python gias_reference.py --repo REPO --model model.pt --generator decoder.pt --data data.npz --out out.npz

``model.pt`` and ``decoder.pt`` are TorchScript modules: the attacked classifier (images in [0, 1]) and the
generator (codes n × latent ↦ images in [0, 1]).  ``data.npz`` holds the images ``x``, labels ``y`` and ``latent``.
The attack is the reference's ``GradientReconstructor`` with ``gias=True``: a latent search per restart, the best
code kept, then one generator copy per image fine-tuned, each restart's (``reconstruction_algorithms.py``),
labels given, one gradient of the mean loss.  Its options are the reference's own for 32-px images
(``scripts/ours_v2_bs4.sh``: cosine cost ``sim``, Adam lr 3e-2 on codes and 1e-3 on the generators, MultiStepLR,
TV 1e-6, no BN / norm / group terms), its step counts given here.

Two adaptations, both of the harness and not of the algorithm:

* the generator is the reference's plain ``G(z)`` branch (``generative_model='DCGAN'``: codes n × 100 × 1 × 1,
  images in [−1, 1]); the wrapper feeds the first ``latent`` code entries to the decoder and maps [0, 1] to [−1, 1]
  (the other entries are unused: the reference's z-norm term is off).  Its ``gias`` stage copies ``G.G_synthesis``
  (a StyleGAN attribute): the wrapper names itself so.
* that stage moves every copy to the literal device ``'cuda:0'``; without CUDA the harness maps that device to the
  CPU.
"""
from __future__ import annotations

import copy
import time

import numpy as np
import torch


class Wrapped(torch.nn.Module):
    """The leakbench decoder as the reference's DCGAN-shaped generator: z (n × 100 × 1 × 1) ↦ images in [−1, 1]."""

    def __init__(self, decoder: torch.nn.Module, latent: int) -> None:
        super().__init__()
        self.decoder, self.latent = decoder, latent
        object.__setattr__(self, "G_synthesis", self)   # not a submodule: the reference deep-copies it

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return 2 * self.decoder(z.flatten(1)[:, : self.latent]) - 1

    def __deepcopy__(self, memo):
        """A copy whose parameters are leaves (a TorchScript module deep-copied under autograd gives non-leaf
        parameters, which the reference's per-image Adam cannot optimise)."""
        with torch.no_grad():
            out = Wrapped(copy.deepcopy(self.decoder, memo), self.latent)
        for mine, theirs in zip(self.parameters(), out.parameters()):
            theirs.requires_grad_(mine.requires_grad)
        return out


def _cuda_to_cpu() -> None:
    """Map the literal device 'cuda:0' the reference's gias stage uses to the CPU (no CUDA here)."""
    def fix(args, kwargs):
        args = tuple("cpu" if a == "cuda:0" else a for a in args)
        if kwargs.get("device") == "cuda:0":
            kwargs = {**kwargs, "device": "cpu"}
        return args, kwargs

    module_to, tensor_to = torch.nn.Module.to, torch.Tensor.to

    def module(self, *args, **kwargs):
        args, kwargs = fix(args, kwargs)
        return module_to(self, *args, **kwargs)

    def tensor(self, *args, **kwargs):
        args, kwargs = fix(args, kwargs)
        return tensor_to(self, *args, **kwargs)

    torch.nn.Module.to, torch.Tensor.to = module, tensor


def main() -> None:
    from _cli import parse

    args = parse(__doc__.splitlines()[0], ("model", "generator", "data"), latent_steps=200, generator_steps=200,
                 restarts=2)
    if not torch.cuda.is_available():
        _cuda_to_cpu()
    from inversefed.reconstruction_algorithms import GradientReconstructor

    data = np.load(args.data, allow_pickle=False)
    x, y = torch.from_numpy(data["x"]).float(), torch.from_numpy(data["y"]).long()
    model = torch.jit.load(args.model).eval()
    gen = Wrapped(torch.jit.load(args.generator).eval(), int(data["latent"]))
    loss = torch.nn.CrossEntropyLoss()
    grads = [g.detach() for g in torch.autograd.grad(loss(model(x), y), list(model.parameters()))]
    config = dict(signed=False, cost_fn="sim", indices="def", weights="equal", lr=3e-2, optim="adam",
                  restarts=args.restarts, max_iterations=args.latent_steps, total_variation=1e-6, bn_stat=0,
                  image_norm=0, z_norm=0, group_lazy=0, init="randn", lr_decay=True, dataset="CIFAR10",
                  generative_model="DCGAN", gen_dataset="", giml=False, gias=True, gias_lr=1e-3,
                  gias_iterations=args.generator_steps)
    c = x.shape[1]
    mean_std = (torch.zeros(c, 1, 1), torch.ones(c, 1, 1))   # the model takes images in [0, 1]
    machine = GradientReconstructor(model, mean_std, config, num_images=len(y), G=gen)
    start = time.perf_counter()
    out, stats = machine.reconstruct(grads, y, img_shape=tuple(x.shape[1:]))
    seconds = time.perf_counter() - start
    np.savez(args.out, final=out.detach().clamp(0, 1).numpy(), seconds=np.asarray(seconds),
             score=np.asarray(float(stats["opt"])))


if __name__ == "__main__":
    main()
