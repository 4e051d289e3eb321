"""Learned image priors: a small convolutional VAE the library trains itself on public images, and user generators.

Generative gradient-inversion attacks (Jeon et al. 2021, GIAS; Li et al. 2022, GGL; Fang et al. 2023, GIFD) search
the latent space of a generator trained on data like the client's.  :func:`learned_generator` gives one offline:

* **Architecture** — :class:`ConvDecoder`: z ∈ R^k ↦ Linear → (2w × ⌈H/4⌉ × ⌈W/4⌉) → [×2 nearest, conv3×3,
  LeakyReLU] twice → conv3×3 → crop/resize to H × W → sigmoid, images in (0, 1).  No normalisation layer: every
  image depends on its own code only (a batch is generated sample by sample).  :class:`ConvEncoder` mirrors it
  (two stride-2 convolutions, a linear layer to the mean and log-variance).
* **Training** — a VAE (Kingma & Welling 2014): the negative ELBO with a Bernoulli likelihood (binary cross-entropy
  summed over pixels) and β·KL(q(z|x) ‖ N(0, I)), Adam, minibatches drawn from a seeded generator, on one thread
  in about half a minute for digits at 28 × 28 (the defaults: latent 16, width 8,
  1 200 steps of 32 images; a held-out digit is fitted by its best code to ~25 dB).  The decoder's output for z ~ N(0, I) is then an
  image prior; its latent is what the attack searches.
* **Public data** (:data:`PUBLIC`) — ``digits``: scikit-learn's digits with index 0–999 (the attacked digits images
  must come from index 1 000 on: that range is never trained on; the benchmarks attack there); ``photos``: the
  bundled photo patches (all); a folder of images (``folder`` dataset, labels ignored) or a ``.npz`` file (arrays
  ``x``, ``y``): all of it, the user's declaration that it is public.  Images are resized to the attacked shape.
* **Cache** — the decoder's state dict (tensors only, ``torch.save``), read back with ``weights_only=True``, in
  ``cache_dir`` (default ``$LEAKBENCH_CACHE/generators`` or ``~/.cache/leakbench/generators``), keyed by a SHA-256
  of the public images' bytes, the image shape, the architecture's version and sizes, and every training option
  (seed and steps included).  The same key always yields the same weights (seeded, deterministic on one device).

:func:`user_generator` builds a user's ``module:Class`` generator (the same import rule as model classes,
:mod:`.custom`), loads its weights from a state-dict file (``weights_only=True``) and probes it on one code.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..data import load
from ..errors import ConfigError, expect
from .custom import import_class

__all__ = ["ConvDecoder", "ConvEncoder", "PriorConfig", "PUBLIC", "PUBLIC_DIGITS", "public_images", "train_vae",
           "learned_generator", "user_generator", "generator_cache_dir", "generator_stages"]

#: bump when :class:`ConvDecoder` / :class:`ConvEncoder` or the training loop change (a new cache key)
ARCHITECTURE = "conv-vae-1"
#: the digits images reserved as public data for the library's own generator (attack images from 1 000 on)
PUBLIC_DIGITS = range(0, 1000)
#: the bundled public datasets (besides a folder or a ``.npz`` path)
PUBLIC = ("digits", "photos")


def _shape(out_shape: Sequence[int]) -> tuple[int, int, int]:
    shape = tuple(int(s) for s in out_shape)
    expect(len(shape) == 3 and all(s >= 1 for s in shape),
           f"expected an image shape (C, H, W) of positive sizes, got {tuple(out_shape)!r}")
    return shape  # type: ignore[return-value]


class ConvDecoder(nn.Module):
    """z (n × latent) ↦ images (n × C × H × W) in (0, 1)."""

    def __init__(self, latent: int, out_shape: Sequence[int], *, width: int = 16) -> None:
        super().__init__()
        expect(latent >= 1 and width >= 1, f"expected latent ≥ 1 and width ≥ 1, got {latent} and {width}")
        self.latent, self.out_shape, self.width = int(latent), _shape(out_shape), int(width)
        c, h, w = self.out_shape
        self.base = (math.ceil(h / 4), math.ceil(w / 4))
        self.fc = nn.Linear(latent, 2 * width * self.base[0] * self.base[1])
        self.conv1 = nn.Conv2d(2 * width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.out = nn.Conv2d(width, c, 3, padding=1)

    def stages(self) -> list:
        """The decoder as the composition of its stages (z → fc → conv1 → conv2 → image): each callable maps the
        previous stage's output to the next, so that an attack can search an intermediate feature space (GIFD)."""
        def fc(z):
            return F.leaky_relu(self.fc(z), 0.2).reshape(z.shape[0], 2 * self.width, *self.base)   # traceable

        def conv1(h):
            return F.leaky_relu(self.conv1(F.interpolate(h, scale_factor=2.0, mode="nearest")), 0.2)

        def conv2(h):
            return F.leaky_relu(self.conv2(F.interpolate(h, scale_factor=2.0, mode="nearest")), 0.2)

        def out(h):
            h = self.out(h)
            if tuple(h.shape[-2:]) != self.out_shape[1:]:
                h = h[..., : self.out_shape[1], : self.out_shape[2]]
            return torch.sigmoid(h)

        return [fc, conv1, conv2, out]

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        for stage in self.stages():
            z = stage(z)
        return z


def generator_stages(gen: nn.Module, *, field: str = "option generator") -> list:
    """A generator as a list of callables whose composition is ``gen``: its ``stages()`` when it has one (the
    library's :class:`ConvDecoder`), the children of an ``nn.Sequential``; otherwise a one-line error."""
    if callable(getattr(gen, "stages", None)):
        stages = list(gen.stages())
    elif isinstance(gen, nn.Sequential):
        stages = list(gen.children())
    else:
        raise ConfigError(f"expected a generator in stages (an nn.Sequential, or a stages() method returning the "
                          f"callables in order), got {type(gen).__name__} ({field})")
    expect(len(stages) >= 2, f"expected a generator of at least 2 stages, got {len(stages)} ({field})")
    return stages


class ConvEncoder(nn.Module):
    """Images ↦ (mean, log-variance) of q(z | x), each n × latent."""

    def __init__(self, latent: int, in_shape: Sequence[int], *, width: int = 16) -> None:
        super().__init__()
        c, h, w = _shape(in_shape)
        self.conv1 = nn.Conv2d(c, width, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        size = 2 * width * math.ceil(math.ceil(h / 2) / 2) * math.ceil(math.ceil(w / 2) / 2)
        self.fc = nn.Linear(size, 2 * latent)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.leaky_relu(self.conv1(x), 0.2)
        h = F.leaky_relu(self.conv2(h), 0.2).flatten(1)
        mean, logvar = self.fc(h).chunk(2, dim=1)
        return mean, logvar.clamp(-10, 10)


@dataclass(frozen=True)
class PriorConfig:
    """How the library's generator is trained (every field enters the cache key)."""

    latent: int = 16
    width: int = 8
    steps: int = 1200
    batch: int = 32
    lr: float = 2e-3
    beta: float = 1.0
    seed: int = 0

    def check(self) -> None:
        for name in ("latent", "width", "steps", "batch"):
            value = getattr(self, name)
            expect(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"expected an integer {name} ≥ 1, got {value!r} (option {name})")
        expect(self.lr > 0 and self.beta >= 0, f"expected lr > 0 and beta ≥ 0, got {self.lr} and {self.beta}")


def _fit(images: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """``images`` (N × C' × H' × W' in [0, 1]) at ``shape``: channels averaged or repeated, bilinear resize."""
    expect(images.dim() == 4, f"expected public images N×C×H×W, got shape {tuple(images.shape)}")
    c = shape[0]
    if images.shape[1] != c:
        grey = images.mean(1, keepdim=True)
        images = grey.expand(-1, c, -1, -1) if c != 1 else grey
    if tuple(images.shape[-2:]) != shape[1:]:
        images = F.interpolate(images, size=shape[1:], mode="bilinear", align_corners=False).clamp(0, 1)
    return images.float().contiguous()


def public_images(public: str, shape: Sequence[int]) -> torch.Tensor:
    """The public images (N × C × H × W in [0, 1], float32) of ``public`` at the attacked image ``shape``."""
    c, h, w = _shape(shape)
    expect(isinstance(public, str) and public.strip() != "",
           f"expected public data 'digits', 'photos', a folder or a .npz file, got {public!r} (option public)")
    if public == "digits":
        ds = load("digits", size=max(8, h), channels=1)
        images = ds.images[list(PUBLIC_DIGITS)]
    elif public == "photos":
        images = load("photos", size=max(h, w)).images
    else:
        path = Path(public).expanduser()
        if path.is_dir():
            images = load("folder", root=str(path), size=max(h, w)).images
        elif path.suffix == ".npz" and path.is_file():
            images = load("npz", path=str(path)).images
        else:
            raise ConfigError(f"expected public data {', '.join(PUBLIC)}, a folder of images or a .npz file, got "
                              f"{public!r} (option public): no such folder or .npz file")
    expect(len(images) >= 2, f"expected at least 2 public images, got {len(images)} (option public)")
    return _fit(images, (c, h, w))


def train_vae(images: torch.Tensor, config: PriorConfig = PriorConfig(), *,
              progress=None) -> tuple[ConvDecoder, list[float]]:
    """Train :class:`ConvEncoder` + :class:`ConvDecoder` as a VAE on ``images`` (in [0, 1]); the decoder (eval
    mode, on the CPU) and the loss (negative ELBO per image) every 50 steps.  Seeded: the same inputs give the same
    weights."""
    config.check()
    shape = _shape(images.shape[1:])
    images = images.detach().float().cpu()
    gen = torch.Generator().manual_seed(int(config.seed))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(config.seed))
        encoder = ConvEncoder(config.latent, shape, width=config.width)
        decoder = ConvDecoder(config.latent, shape, width=config.width)
    params = [*encoder.parameters(), *decoder.parameters()]
    opt = torch.optim.Adam(params, lr=config.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=config.steps)
    curve: list[float] = []
    n = len(images)
    for step in range(config.steps):
        idx = torch.randint(0, n, (min(config.batch, n),), generator=gen)
        x = images[idx]
        mean, logvar = encoder(x)
        z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=gen)
        recon = F.binary_cross_entropy(decoder(z), x, reduction="sum") / len(x)
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).sum() / len(x)
        loss = recon + config.beta * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == config.steps - 1:
            curve.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, config.steps, float(loss.detach()))
    return decoder.eval(), curve


def generator_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$LEAKBENCH_CACHE/generators``, else ``~/.cache/leakbench/generators``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    base = os.environ.get("LEAKBENCH_CACHE")
    return Path(base) / "generators" if base else Path.home() / ".cache" / "leakbench" / "generators"


def _key(images: torch.Tensor, shape: tuple[int, int, int], config: PriorConfig) -> str:
    digest = hashlib.sha256(images.numpy().tobytes())
    digest.update(json.dumps({"architecture": ARCHITECTURE, "shape": shape, **asdict(config)},
                             sort_keys=True).encode())
    return digest.hexdigest()[:24]


def learned_generator(shape: Sequence[int], *, public: str = "digits", config: PriorConfig = PriorConfig(),
                      cache: bool = True, cache_dir: str | os.PathLike | None = None,
                      progress=None) -> tuple[ConvDecoder, dict]:
    """The library's decoder for images of ``shape`` trained on ``public`` (cached); (decoder, info) where info
    says the key, the cache file, whether it was trained now and on how many images."""
    shape = _shape(shape)
    config.check()
    images = public_images(public, shape)
    key = _key(images, shape, config)
    path = generator_cache_dir(cache_dir) / f"vae-{key}.pt" if cache else None
    decoder = ConvDecoder(config.latent, shape, width=config.width)
    info = {"key": key, "public": public, "public_images": len(images), "cache_file": str(path) if path else None,
            "config": asdict(config)}
    if path is not None and path.is_file():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            decoder.load_state_dict(saved["decoder"])
            return decoder.eval(), {**info, "trained": False, "vae_loss": list(saved.get("loss", []))}
        except Exception:  # noqa: BLE001 (a broken or foreign cache file is retrained and overwritten)
            pass
    decoder, curve = train_vae(images, config, progress=progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        torch.save({"decoder": decoder.state_dict(), "loss": torch.tensor(curve)}, tmp)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    return decoder, {**info, "trained": True, "vae_loss": curve}


def user_generator(spec: str, shape: Sequence[int], *, latent: int, weights: str | os.PathLike | None = None,
                   field: str = "option generator") -> nn.Module:
    """The user's generator class ``module:Class`` (constructed with ``latent=`` and ``out_shape=`` when its
    constructor takes them), its state dict loaded from ``weights`` (tensors only), probed: codes of shape
    (n, latent) must give images of shape (n, *shape)."""
    shape = _shape(shape)
    cls = import_class(spec, field=field)
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs = {name: value for name, value in (("latent", int(latent)), ("out_shape", shape)) if name in params}
    try:
        gen = cls(**kwargs)
    except Exception as err:  # noqa: BLE001 - the user's constructor: one line
        raise ConfigError(f"constructing generator {spec} raised {type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]} ({field})") from None
    if weights:
        path = Path(weights).expanduser()
        expect(path.is_file(), f"expected a generator weights file, got {str(weights)!r}: no such file "
               "(option generator_file)")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
                state = state["state_dict"]
            gen.load_state_dict(state)
        except Exception as err:  # noqa: BLE001 - one line naming the file
            raise ConfigError(f"loading generator weights {str(weights)!r} into {spec} failed: {type(err).__name__}: "
                              f"{' '.join(str(err).split())[:200]} (option generator_file; a state dict saved "
                              "with torch.save(model.state_dict(), path))") from None
    gen.eval()
    try:
        with torch.no_grad():
            out = gen(torch.zeros(2, int(latent)))
    except Exception as err:  # noqa: BLE001
        raise ConfigError(f"generator {spec} fails on codes of shape (2, {latent}): {type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]} (option latent is its input size)") from None
    expect(isinstance(out, torch.Tensor) and tuple(out.shape) == (2, *shape),
           lambda: f"expected generator {spec} to map codes (2, {latent}) to images (2, {', '.join(map(str, shape))}), "
           f"got {tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__} ({field})")
    return gen
