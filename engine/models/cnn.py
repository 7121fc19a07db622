"""A small convolutional classifier for scikit-learn's bundled ``load_digits`` images.

``cnn-digits`` is an ``nn.Sequential`` (so its stages are cut by the module split, see
:mod:`engine.split`): ``[B, 1, 8, 8]`` float images (pixel values / 16) -> ``[B, 10]`` logits.
Layers: conv 3x3 1->16, ReLU, conv 3x3 16->32, ReLU, max-pool 2 (-> 4x4), flatten, linear
512->64, ReLU, linear 64->10 (about 44k parameters).
"""

from __future__ import annotations

from torch import nn

__all__ = ["digits_cnn"]


def digits_cnn(num_classes: int = 10, channels: tuple[int, int] = (16, 32), hidden: int = 64) -> nn.Sequential:
    """The ``cnn-digits`` network (see the module docstring)."""
    c1, c2 = channels
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(c2 * 4 * 4, hidden), nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )
