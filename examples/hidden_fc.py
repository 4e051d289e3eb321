"""A ConvNet with a hidden ReLU fully connected layer, for ``spear-features`` in a sweep (issue 46).

Conv2d(C → channels, 3×3, padding 1) → ReLU → Flatten → Linear(channels·H·W → width) → ReLU → Linear(width → classes).
Used by ``examples/sweep-spear-features.yaml`` with ``--code-path examples``.
"""
from __future__ import annotations

import math

from torch import nn


class ConvHiddenFC(nn.Module):
    def __init__(self, input_shape, num_classes, channels: int = 8, width: int = 1000):
        super().__init__()
        c = input_shape[0]
        self.net = nn.Sequential(nn.Conv2d(c, channels, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(channels * math.prod(input_shape[1:]), width), nn.ReLU(),
                                 nn.Linear(width, num_classes))

    def forward(self, x):
        return self.net(x)
