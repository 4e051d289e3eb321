"""The chance levels a reconstruction is scored against: a flat image at the data mean (per batch and per
sample), images drawn from outside the batch (non-members, public samples) and the identification pool of IIP."""
from __future__ import annotations

import torch


def chance_scores(x: torch.Tensor, data) -> dict[str, float]:
    """The chance level beside every reconstruction: a flat image at the dataset's mean pixel value.

    An attack whose RMSE is not below ``chance_rmse`` has learnt nothing about the batch
    that the dataset's average colour does not already say.
    """
    from ...metrics.compare import flat_chance

    chance = flat_chance(x, float(data.images.mean()))
    return {"chance_rmse": chance["chance_rmse"], "chance_psnr": chance["chance_psnr"]}


def chance_per_sample(x: torch.Tensor, data) -> list[float]:
    """Each image's own chance RMSE (the flat image at the dataset's mean pixel value), original order."""
    from ...metrics.compare import flat_chance

    return flat_chance(x, float(data.images.mean()))["per_sample"]


def constant_output(images: torch.Tensor) -> bool:
    """True when a reconstruction is one flat value everywhere: an attack's fallback, not a reconstruction."""
    return images.numel() > 1 and bool((images.amax() - images.amin()).abs() <= 1e-12 * max(1.0, float(
        images.abs().amax())))


def draw_excluding(images: torch.Tensor, exclude: torch.Tensor, count: int, *, seed: int) -> torch.Tensor:
    """Indices of a seeded draw of at most ``count`` rows of ``images`` none of which equals a row of ``exclude``.

    Rows are compared by a random projection, then exactly (a projection collision never drops a row).
    """
    flat = images.reshape(images.shape[0], -1).double()
    ex = exclude.reshape(exclude.shape[0], -1).to(flat.device, flat.dtype)
    probe = torch.randn(flat.shape[1], generator=torch.Generator().manual_seed(12345), dtype=torch.float64)
    probe = probe.to(flat.device)
    taken = set((ex @ probe).tolist())
    codes = (flat @ probe).tolist()
    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(int(seed))).tolist()
    keep = [i for i in order if codes[i] not in taken or not (ex == flat[i]).all(1).any()][:count]
    return torch.as_tensor(keep, dtype=torch.long)


def public_sample(data, exclude: torch.Tensor, count: int, *, seed: int,
                  labelled: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``count`` images of ``data`` the server may hold: a seeded draw that contains none of ``exclude``
    (``labelled``: the pair (images, their labels), for a server that places a class's threshold).

    The client's images never calibrate the server's block.  Fewer than ``count`` are returned when the
    data is short.
    """
    idx = draw_excluding(data.images, exclude, count, seed=int(seed) + 10007)
    images = data.images[idx.to(data.images.device)]
    return (images, data.labels[idx.to(data.labels.device)]) if labelled else images


#: the most images an IIP pool holds: the batch's originals plus a seeded draw of other images of the dataset
IIP_POOL = 256


def identification_pool(x: torch.Tensor, data, *, seed: int) -> torch.Tensor:
    """The candidates of the trial's IIP (:func:`leakbench.metrics.identify.iip`): the originals ``x`` first, then a
    seeded draw of up to ``IIP_POOL − B`` other images of ``data`` (none equal to an original).  Only the
    ``IIP_POOL`` drawn candidates are read and compared, never the whole dataset."""
    b = x.shape[0]
    pick = torch.randperm(len(data.images), generator=torch.Generator().manual_seed(int(seed) + 20011))[:IIP_POOL]
    others = data.images[pick.to(data.images.device)].to(x.device, x.dtype)
    same = torch.cdist(others.reshape(len(others), -1).double(), x.reshape(b, -1).double(),
                       compute_mode="donot_use_mm_for_euclid_dist") == 0
    return torch.cat([x, others[~same.any(1)][: max(0, IIP_POOL - b)]])


def model_features(model: torch.nn.Module, x: torch.Tensor):
    """The feature map of the trial's feature-space IIP: the observed model's penultimate features
    (:func:`leakbench.metrics.identify.penultimate_features`), or None for a model without a linear layer or whose
    forward pass on the batch fails (then only the pixel-space IIP is stored)."""
    from ...metrics.identify import penultimate_features

    try:
        fn = penultimate_features(model)
        fn(x[:1])
    except Exception:  # noqa: BLE001 - an optional score: a model it cannot read leaves it out
        return None
    return fn


__all__ = ["public_sample", "draw_excluding", "chance_scores", "chance_per_sample", "constant_output"]
