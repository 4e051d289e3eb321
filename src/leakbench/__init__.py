"""leakbench — measure how much of a network's training data can be rebuilt from what training shares.

    import leakbench as lb
    data  = lb.load("photos")
    model = lb.build("convnet-16", input_shape=data.shape, classes=data.num_classes, seed=0)
    x, y  = data.batch(1, seed=0)
    obs   = lb.observe(model, x, y)
    rec   = lb.attack("inverting-gradients", obs, preset="quick")
    lb.compare(rec, x, y)   # {"mse": …, "psnr": …, "ssim": …, "label_acc": …}
    lb.inspect(model, received, x=x, y=y)   # the client's check: is the model it was sent malicious?
"""
from __future__ import annotations

from ._startup import install as _install_startup_hook

_install_startup_hook()  # Ctrl-C while the CLI imports torch: one line, exit 130 (the command line only)

from . import analysis  # noqa: E402
from .analysis import inspect  # noqa: E402
from .attacks import ATTACKS, Reconstruction, attack  # noqa: E402
from .data import DATASETS, ImageDataset, load  # noqa: E402
from .defenses import DEFENSES  # noqa: E402
from .errors import ConfigError, DataNotFound, LeakbenchError, UnsupportedThreatModel  # noqa: E402
from .evaluation import evaluate  # noqa: E402
from .evaluation.training.utility import utility  # noqa: E402
from .metrics import compare  # noqa: E402
from .models import MODELS, build  # noqa: E402
from .models.targets import train_target  # noqa: E402
from .threat import Observation, observe, observe_weights, requery  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "load", "build", "observe", "observe_weights", "requery", "attack", "compare", "evaluate", "utility", "train_target",
    "inspect",
    "analysis",
    "ImageDataset", "Observation", "Reconstruction",
    "DATASETS", "MODELS", "ATTACKS", "DEFENSES",
    "LeakbenchError", "ConfigError", "UnsupportedThreatModel", "DataNotFound",
]
