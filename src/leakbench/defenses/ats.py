"""ATS: training on images transformed by a searched augmentation policy (``ats[:policy[,seed]]``).

Gao, Guo, Zhang, Qiu, Wen & Liu, "Privacy-preserving Collaborative Learning with Automatic Transformation
Search", CVPR 2021.  The client preprocesses every training image by a policy — k transformations applied in
order, drawn from a library of 50 (Sec. 3–4; AutoAugment's operations at fixed magnitudes) — and shares the
gradient of the loss at the transformed images, ∇θ ℓ(f(T(x)), y).  The library is the authors' ``policy.py``:
entry i is (operation, magnitude index), the magnitude the index's point on the operation's range (their
``autoaugment.SubPolicy``; the per-entry probability there is never used, every entry is applied).  Random
choices are theirs too: translations, shears, contrast, brightness and colour pick a sign ± per image.

- ``ats:3-1-7`` (default) and ``ats:43-18-18``: the two policies the authors searched for CIFAR-100/ResNet-20
  (``benchmark/run/benchmark_attack.sh``): translateX 45 % · contrast ±0.33 · translateY 10 %, and
  translateY 15 % · contrast ±0.39 · contrast ±0.39.  Any other list of library indices ``a-b-c`` is accepted
  when its operations are implemented here.
- ``ats:random[,seed]``: three library entries drawn uniformly (with replacement, among the implemented ones)
  by a generator seeded with ``seed`` — the paper's random-policy baseline; the spec fixes the policy, so the
  server knows it, as it knows a searched one.
- ``ats:3-1-7/43-18-18``: a **hybrid** policy (Gao et al.'s hybrid strategy, written ``3-1-7+43-18-18`` in their
  scripts, whose parser splits the list on ``+``; here ``/``, since ``+`` chains defenses): each image is
  transformed by one of the policies, drawn uniformly per image (their transform picks one sub-policy at random
  per sample), then by that policy's signs.  The server knows the policies, not which one an image got.

The operations act on batches in torch, with PIL's conventions for pixels in [0, 1]: affine maps from output to
input pixel centres (shear: bicubic, fill 0; translate: whole-pixel shift ⌊t + ½⌋, fill 0; rotate: nearest,
about the centre, fill 128/255), ImageEnhance's blends with clipping (brightness: towards black; contrast:
towards the mean grey level, which PIL rounds to an integer level and we do not; colour: towards the L image),
invert, autocontrast (per channel, no cut-off) and solarize.  posterize, equalize and sharpness are not
implemented (library entries that use them are refused).  Every operation is differentiable almost everywhere in
x, which the adaptive attack (``ats-adaptive``) uses.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .base import register
from .literature import _StepDefense

#: the 50 library entries of the authors' policy.py: (operation, magnitude index 0..9)
LIBRARY: tuple[tuple[str, int], ...] = (
    ("invert", 7), ("contrast", 6), ("rotate", 2), ("translateX", 9), ("sharpness", 1),
    ("sharpness", 3), ("shearY", 2), ("translateY", 2), ("autocontrast", 5), ("equalize", 2),
    ("shearY", 5), ("posterize", 5), ("color", 3), ("brightness", 5), ("sharpness", 9),
    ("brightness", 9), ("equalize", 5), ("equalize", 1), ("contrast", 7), ("sharpness", 5),
    ("color", 5), ("translateX", 5), ("equalize", 7), ("autocontrast", 8), ("translateY", 3),
    ("sharpness", 6), ("brightness", 6), ("color", 8), ("solarize", 0), ("invert", 0),
    ("equalize", 0), ("autocontrast", 0), ("equalize", 8), ("equalize", 4), ("color", 5),
    ("equalize", 5), ("autocontrast", 4), ("solarize", 4), ("brightness", 3), ("color", 0),
    ("solarize", 1), ("autocontrast", 0), ("translateY", 3), ("translateY", 3), ("autocontrast", 1),
    ("solarize", 1), ("equalize", 5), ("invert", 0), ("translateY", 3), ("autocontrast", 1),
)
#: each operation's magnitude range (magnitude index i → lo + (hi − lo)·i/9), as in the authors' SubPolicy
RANGES = {"shearX": (0.0, 0.3), "shearY": (0.0, 0.3), "translateX": (0.0, 150 / 331),
          "translateY": (0.0, 150 / 331), "rotate": (0.0, 30.0), "color": (0.0, 0.5), "solarize": (256.0, 0.0),
          "contrast": (0.0, 0.5), "brightness": (0.0, 0.5)}
#: operations that draw a sign ± per image
SIGNED = ("shearX", "shearY", "translateX", "translateY", "color", "contrast", "brightness")
IMPLEMENTED = SIGNED + ("rotate", "invert", "autocontrast", "solarize")
#: the policies Gao et al. searched (CIFAR-100, ResNet-20), as library indices
SEARCHED = {"3-1-7": (3, 1, 7), "43-18-18": (43, 18, 18)}
MAX_OPS = 8


def magnitude(op: str, index: int) -> float:
    lo, hi = RANGES.get(op, (0.0, 0.0))
    return lo + (hi - lo) * index / 9


def parse_policy(policy: str, seed: int = 0) -> tuple[int, ...]:
    """The policy's library indices: a searched name, ``random`` (three seeded draws) or ``a-b-c``."""
    if policy in SEARCHED:
        return SEARCHED[policy]
    usable = [i for i, (op, _) in enumerate(LIBRARY) if op in IMPLEMENTED]
    if policy == "random":
        gen = torch.Generator().manual_seed(int(seed))
        return tuple(usable[int(i)] for i in torch.randint(len(usable), (3,), generator=gen))
    try:
        indices = tuple(int(p) for p in str(policy).split("-"))
    except ValueError:
        indices = ()
    if not indices or len(indices) > MAX_OPS or any(not 0 <= i < len(LIBRARY) for i in indices):
        raise ConfigError(f"expected the policy as 'random', a searched policy ({', '.join(SEARCHED)}) or 1 to "
                          f"{MAX_OPS} library indices 0..{len(LIBRARY) - 1} joined by '-', got {policy!r} "
                          "(defense 'ats', field policy)")
    missing = sorted({LIBRARY[i][0] for i in indices} - set(IMPLEMENTED))
    if missing:
        raise ConfigError(f"expected library entries whose operations are implemented ({', '.join(IMPLEMENTED)}), "
                          f"got {', '.join(missing)} in policy {policy!r} (defense 'ats', field policy)")
    return indices


#: the most policies a hybrid combines
MAX_POLICIES = 4


def parse_policies(policy: str, seed: int = 0) -> tuple[tuple[int, ...], ...]:
    """The policies of ``policy``: one (:func:`parse_policy`), or a hybrid of 2 to :data:`MAX_POLICIES` joined by
    ``/`` (each image transformed by one of them)."""
    parts = str(policy).split("/")
    if len(parts) > MAX_POLICIES or any(not p.strip() for p in parts):
        raise ConfigError(f"expected one policy or a hybrid of at most {MAX_POLICIES} policies joined by '/', e.g. "
                          f"3-1-7/43-18-18, got {policy!r} (defense 'ats', field policy)")
    return tuple(parse_policy(p.strip(), seed) for p in parts)


def _affine(x: torch.Tensor, a: torch.Tensor, c: torch.Tensor, *, mode: str, fill: float) -> torch.Tensor:
    """Sample x at u_in = A u_out + c (pixel-centre coordinates from the top-left corner, B × 2 × 2 and B × 2)."""
    b, _, h, w = x.shape
    d = torch.tensor([w / 2, h / 2], dtype=x.dtype, device=x.device)
    lin = a / d[None, :, None] * d[None, None, :]  # D⁻¹ A D
    off = ((a * d[None, None, :]).sum(-1) + c) / d - 1  # D⁻¹ (A D 1 + c) − 1
    theta = torch.cat([lin, off[..., None]], -1).to(x.dtype)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode=mode, padding_mode="zeros", align_corners=False)
    if fill:
        inside = F.grid_sample(torch.ones_like(x[:, :1]), grid, mode=mode, padding_mode="zeros",
                               align_corners=False)
        out = out + fill * (1 - inside)
    return out


def _luminance(x: torch.Tensor) -> torch.Tensor:
    """PIL's L = 0.299 R + 0.587 G + 0.114 B (the image itself for one channel), B × 1 × H × W."""
    if x.shape[1] != 3:
        return x.mean(1, keepdim=True)
    return (x * torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype, device=x.device)[None, :, None, None]).sum(
        1, keepdim=True)


def apply_op(x: torch.Tensor, op: str, mag: float, sign: torch.Tensor) -> torch.Tensor:
    """One library operation on a batch in [0, 1]; ``sign`` (B,) of ±1 for the signed operations."""
    b, _, h, w = x.shape
    eye = torch.eye(2, dtype=x.dtype, device=x.device).expand(b, 2, 2)
    zero = torch.zeros(b, 2, dtype=x.dtype, device=x.device)
    s = sign.to(x.dtype)
    view = s.view(-1, 1, 1, 1)
    if op in ("translateX", "translateY"):  # PIL nearest at x + ½ + t: a whole-pixel shift by ⌊t + ½⌋
        size = w if op == "translateX" else h
        shift = torch.floor(s * mag * size + 0.5)
        c = torch.stack([shift, torch.zeros_like(shift)] if op == "translateX" else [torch.zeros_like(shift), shift], 1)
        return _affine(x, eye, c, mode="nearest", fill=0.0)
    if op in ("shearX", "shearY"):
        a = eye.clone()
        a[:, 0, 1] = s * mag if op == "shearX" else 0
        a[:, 1, 0] = s * mag if op == "shearY" else 0
        return _affine(x, a, zero, mode="bicubic", fill=0.0).clamp(0, 1)
    if op == "rotate":  # PIL rotate(mag): counter-clockwise about the centre, a = −mag in radians
        t = -math.radians(mag)
        a = torch.tensor([[math.cos(t), math.sin(t)], [-math.sin(t), math.cos(t)]], dtype=x.dtype,
                         device=x.device).expand(b, 2, 2)
        centre = torch.tensor([w / 2, h / 2], dtype=x.dtype, device=x.device)
        c = (centre - a[0] @ centre).expand(b, 2)
        return _affine(x, a, c, mode="nearest", fill=128 / 255)
    if op == "brightness":
        return ((1 + view * mag) * x).clamp(0, 1)
    if op == "contrast":
        grey = _luminance(x).mean((1, 2, 3), keepdim=True)
        return (grey + (1 + view * mag) * (x - grey)).clamp(0, 1)
    if op == "color":
        grey = _luminance(x)
        return (grey + (1 + view * mag) * (x - grey)).clamp(0, 1)
    if op == "invert":
        return 1 - x
    if op == "autocontrast":
        lo, hi = x.amin((2, 3), keepdim=True), x.amax((2, 3), keepdim=True)
        return torch.where(hi > lo, (x - lo) / (hi - lo).clamp_min(1e-12), x)
    if op == "solarize":
        return torch.where(x * 255 >= mag, 1 - x, x)
    raise ConfigError(f"expected an implemented ATS operation ({', '.join(IMPLEMENTED)}), got {op!r}")


def signed_count(indices: tuple[int, ...]) -> int:
    """How many of the policy's operations draw a sign per image."""
    return sum(LIBRARY[i][0] in SIGNED for i in indices)


def draw_signs(batch: int, indices: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """B × (signed operations) random ±1 (one per image and signed operation, as ``random.choice([-1, 1])``)."""
    return torch.where(torch.rand(batch, signed_count(indices), generator=generator) < 0.5, -1.0, 1.0)


def transform(x: torch.Tensor, indices: tuple[int, ...], signs: torch.Tensor) -> torch.Tensor:
    """T(x): the policy's operations in order, the signed ones taking the columns of ``signs`` in order."""
    if x.dim() != 4:
        raise ConfigError(f"defense ats transforms images B×C×H×W, got inputs of shape {tuple(x.shape)}")
    column = 0
    for i in indices:
        op, m = LIBRARY[i]
        sign = signs[:, column].to(x.device) if op in SIGNED else torch.ones(x.shape[0], device=x.device)
        column += op in SIGNED
        x = apply_op(x, op, magnitude(op, m), sign)
    return x


def hybrid_transform(x: torch.Tensor, policies: tuple[tuple[int, ...], ...], choice: torch.Tensor,
                     signs: torch.Tensor) -> torch.Tensor:
    """T(x) under a hybrid: image i by policy ``choice[i]`` with the first columns of its row of ``signs``."""
    if len(policies) == 1:
        return transform(x, policies[0], signs[:, :signed_count(policies[0])])
    out = x.clone()
    choice = choice.to(x.device)
    for p, indices in enumerate(policies):
        rows = torch.nonzero(choice == p).flatten()
        if len(rows):
            out[rows] = transform(x[rows], indices, signs[rows.cpu(), :signed_count(indices)])
    return out


def draw_hybrid(batch: int, policies: tuple[tuple[int, ...], ...], generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(each image's policy, B × max signed ±1): one policy uniformly per image, then its signs (a single policy
    draws its signs only, as before hybrids existed)."""
    if len(policies) == 1:
        return torch.zeros(batch, dtype=torch.long), draw_signs(batch, policies[0], generator)
    choice = torch.randint(len(policies), (batch,), generator=generator)
    m = max(signed_count(p) for p in policies)
    signs = torch.where(torch.rand(batch, m, generator=generator) < 0.5, -1.0, 1.0)
    return choice, signs


def ats_gradient(model, params, x, y, loss_fn, generator, *,
                 policies: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
    """∇θ ℓ(f(T(x)), y) with each image's policy (a hybrid) and signs drawn from ``generator``."""
    from .pipeline import mean_gradient

    choice, signs = draw_hybrid(x.shape[0], policies, generator)
    return mean_gradient(model, params, hybrid_transform(x, policies, choice, signs), y, loss_fn, generator)


@register("ats", help="ATS (Gao et al. 2021): train on images transformed by an augmentation policy — a searched one "
                      "(3-1-7, 43-18-18), library indices a-b-c, random[,seed], or a hybrid p1/p2 (one policy per "
                      "image) (ats[:policy[,seed]])")
class ATS(_StepDefense):
    def __init__(self, policy: str = "3-1-7", seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"expected an int seed for defense 'ats', got {seed!r}")
        self.policy, self.seed = str(policy), seed
        self.policies = parse_policies(self.policy, seed)
        self.indices = self.policies[0]     # the policy (the first of a hybrid's)

    def gradient(self, model, params, x, y, loss_fn, generator):
        return ats_gradient(model, params, x, y, loss_fn, generator, policies=self.policies)

    def describe(self) -> dict[str, Any]:
        def one(indices):
            return {"library_indices": list(indices),
                    "operations": [f"{LIBRARY[i][0]}:{magnitude(*LIBRARY[i]):.4g}" for i in indices],
                    "signed": signed_count(indices)}
        if len(self.policies) == 1:
            return {"policy": self.policy, **one(self.indices)}
        return {"policy": self.policy, "hybrid": [one(p) for p in self.policies]}


__all__ = ["ATS", "LIBRARY", "SEARCHED", "IMPLEMENTED", "SIGNED", "parse_policy", "parse_policies", "apply_op",
           "transform", "hybrid_transform", "draw_signs", "draw_hybrid", "signed_count", "ats_gradient", "magnitude"]
