"""Run breaching's Inverting Gradients on a model and images given as files; write its PSNR-time snapshots.

Started by ``benchmarks/bench_peers.py`` with the Python of a breaching environment
(``LEAKBENCH_BREACHING_PYTHON``), never imported by leakbench: breaching needs torchvision, which does
not import beside leakbench's CPU torch.  It imports breaching, torch and NumPy only::

    python breaching_ig.py --model model.pt --data data.npz --iterations 2000 --every 25 --out out.npz

``model.pt`` is a TorchScript module that takes images normalised with the ``mean``/``std`` of
``data.npz`` (as breaching's own models do); ``data.npz`` holds the images ``x`` in [0, 1] and labels
``y``.  The attack is breaching's ``invertinggradients`` config (cosine objective, TV 0.2, signed Adam,
step 0.1 in normalised units, step-lr decay, box) with ``optim.max_iterations`` set, labels given (as
leakbench's ``labels_known=True``), one restart, FedSGD (one gradient of the mean loss).  Every
``every`` steps the current candidate is copied out (off the clock) with the seconds so far.
"""
from __future__ import annotations

import argparse
import time
import types

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import breaching

    device = torch.device(args.device)
    data = np.load(args.data, allow_pickle=False)
    x, y = torch.from_numpy(data["x"]).float().to(device), torch.from_numpy(data["y"]).long().to(device)
    mean, std = [float(v) for v in data["mean"]], [float(v) for v in data["std"]]
    model = torch.jit.load(args.model, map_location=device).eval()
    loss = torch.nn.CrossEntropyLoss()
    cfg = breaching.get_attack_config("invertinggradients", overrides=[f"optim.max_iterations={args.iterations}"])
    attacker = breaching.attacks.prepare_attack(model, loss, cfg, dict(dtype=torch.float, device=device))
    dm, ds = (torch.tensor(v, device=device)[None, :, None, None] for v in (mean, std))
    grads = torch.autograd.grad(loss(model((x - dm) / ds), y), list(model.parameters()))
    metadata = types.SimpleNamespace(shape=tuple(x.shape[1:]), mean=tuple(mean), std=tuple(std), modality="vision")
    payload = [dict(parameters=[p.detach().clone() for p in model.parameters()],
                    buffers=[b.detach().clone() for b in model.buffers()], metadata=metadata)]
    shared = [dict(gradients=[g.detach() for g in grads], buffers=None,
                   metadata=dict(num_data_points=len(y), labels=y.clone(), local_hyperparams=None))]

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # its first use imports torch._dynamo (seconds): not timed

    steps, seconds, snapshots = [], [], []
    paused = [0.0]
    start = [0.0]
    objective = attacker._compute_objective

    def spy(candidate, labels, rec_model, optimizer, shared_data, iteration):
        if iteration % args.every == 0:  # the candidate after ``iteration`` steps
            if device.type == "cuda":
                torch.cuda.synchronize()  # the steps so far are on the clock, the copy is not
            t = time.perf_counter()
            steps.append(iteration)
            seconds.append(t - start[0] - paused[0])
            snapshots.append((candidate.detach() * ds + dm).clamp(0, 1).cpu().numpy())
            paused[0] += time.perf_counter() - t
        return objective(candidate, labels, rec_model, optimizer, shared_data, iteration)

    attacker._compute_objective = spy
    start[0] = time.perf_counter()
    output, _ = attacker.reconstruct(payload, shared, {}, dryrun=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - start[0] - paused[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    final = (output["data"].detach() * ds + dm).clamp(0, 1).cpu().numpy()
    np.savez(args.out, steps=np.asarray(steps), seconds=np.asarray(seconds), images=np.stack(snapshots),
             final=final, total=np.asarray(total), iterations=np.asarray(args.iterations),
             version=np.asarray(str(getattr(breaching, "__version__", "unknown"))))


if __name__ == "__main__":
    main()
