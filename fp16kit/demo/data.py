"""The demo's dataset: scikit-learn's handwritten digits (1797 8x8 images, 10 classes, shipped inside the
scikit-learn wheel, so nothing is downloaded)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Digits", "load_digits_split"]


@dataclass
class Digits:
    x_train: torch.Tensor  # fp32 [n, 64], standardised with the training set's statistics
    y_train: torch.Tensor  # int64 [n]
    x_test: torch.Tensor
    y_test: torch.Tensor

    def to(self, device: torch.device) -> Digits:
        return Digits(*(t.to(device) for t in (self.x_train, self.y_train, self.x_test, self.y_test)))


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> Digits:
    """A fixed shuffled train/test split; pixels standardised per feature (train statistics)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = int(len(y) * test_fraction)
    x_train, x_test = x[n_test:], x[:n_test]
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-3)  # constant-zero border pixels: std 0
    return Digits((x_train - mean) / std, y[n_test:], (x_test - mean) / std, y[:n_test])
