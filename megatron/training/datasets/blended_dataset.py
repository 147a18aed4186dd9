"""Weighted blend of several datasets, with megatron-core's deterministic greedy interleaving.

Sample ``i`` of the blend comes from the dataset whose share is furthest behind its weight after
``i`` samples (ties to the lowest index), so any prefix of the blend follows the weights as
closely as whole samples allow, and the order depends on nothing but the weights.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# megatron-core asks each blended dataset for 0.5% more samples than its share, so rounding
# in the greedy interleave never runs one dry.
BLEND_MARGIN = 1.005


def normalize_weights(weights: list[float]) -> list[float]:
    """Weights scaled to sum to 1; each must be >= 0 and the sum > 0."""
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--data-path weights must be non-negative with a positive sum, got {weights}")
    total = float(sum(weights))
    return [w / total for w in weights]


def samples_per_dataset(weights: list[float], num_samples: int) -> list[int]:
    """How many samples to build from each dataset of a blend of ``num_samples``."""
    return [int(math.ceil(math.ceil(num_samples * w) * BLEND_MARGIN)) for w in weights]


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each sample, sample within that dataset) for a blend of ``size`` samples."""
    w = [float(x) for x in weights]
    current = [0] * len(w)
    choices = range(len(w))
    dataset_index = np.empty(size, dtype=np.int16)
    for i in range(size):
        step = max(i, 1)
        # plain Python: per-sample numpy calls on a handful of weights cost ~10x more
        d = max(choices, key=lambda k: (w[k] * step - current[k], -k))
        dataset_index[i] = d
        current[d] += 1
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for d in choices:
        mask = dataset_index == d
        dataset_sample_index[mask] = np.arange(int(mask.sum()), dtype=np.int64)
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``."""

    def __init__(self, datasets: list[torch.utils.data.Dataset], weights: list[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = datasets
        self.weights = normalize_weights(list(weights))
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
        for d, dataset in enumerate(datasets):
            needed = int((self.dataset_index == d).sum())
            if needed > len(dataset):
                raise ValueError(f"blend needs {needed} samples from dataset {d} but it has {len(dataset)}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
