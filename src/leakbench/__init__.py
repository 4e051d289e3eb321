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

from . import analysis
from .attacks import ATTACKS, Reconstruction, attack
from .data import DATASETS, ImageDataset, load
from .defenses import DEFENSES
from .errors import ConfigError, DataNotFound, LeakbenchError, UnsupportedThreatModel
from .evaluation import evaluate
from .evaluation.utility import utility
from .metrics import compare
from .models import MODELS, build
from .models.targets import train_target
from .threat import Observation, observe, observe_weights

__version__ = "0.1.0"

__all__ = [
    "load", "build", "observe", "observe_weights", "attack", "compare", "evaluate", "utility", "train_target",
    "analysis",
    "ImageDataset", "Observation", "Reconstruction",
    "DATASETS", "MODELS", "ATTACKS", "DEFENSES",
    "LeakbenchError", "ConfigError", "UnsupportedThreatModel", "DataNotFound",
]
