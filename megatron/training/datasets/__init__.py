"""Datasets for GPT pretraining: Megatron's indexed format, GPT samples, blends and mock data.

Names are imported lazily so that ``indexed_dataset`` (numpy only) loads without torch: the
preprocessing tool starts in a fraction of a second that way.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BlendedDataset": "blended_dataset",
    "GPTDataset": "gpt_dataset",
    "make_sample": "gpt_dataset",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetBuilder": "indexed_dataset",
    "optimal_dtype": "indexed_dataset",
    "MockLowLevelDataset": "mock_dataset",
    "build_train_valid_test_datasets": "builder",
    "parse_data_path": "builder",
    "parse_split": "builder",
    "train_valid_test_num_samples": "builder",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
