"""leakbench — measure how much of a network's training data can be rebuilt from what training shares.

    import leakbench as lb
    data  = lb.load("photos")
    model = lb.build("convnet-16", input_shape=data.shape, classes=data.num_classes, seed=0)
    x, y  = data.batch(1, seed=0)
    obs   = lb.observe(model, x, y)
    rec   = lb.attack("inverting-gradients", obs, preset="quick")
    lb.compare(rec, x, y)   # {"mse": …, "psnr": …, "ssim": …, "label_acc": …}
"""
from __future__ import annotations

from .attacks import ATTACKS, Reconstruction, attack
from .data import DATASETS, ImageDataset, load
from .defenses import DEFENSES
from .errors import ConfigError, DataNotFound, LeakbenchError, UnsupportedThreatModel
from .metrics import compare
from .models import MODELS, build
from .threat import Observation, observe

__version__ = "0.1.0"

__all__ = [
    "load", "build", "observe", "attack", "compare",
    "ImageDataset", "Observation", "Reconstruction",
    "DATASETS", "MODELS", "ATTACKS", "DEFENSES",
    "LeakbenchError", "ConfigError", "UnsupportedThreatModel", "DataNotFound",
]
