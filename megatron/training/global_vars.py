"""The parsed arguments of the running job, as Megatron's ``get_args()`` offers them to model providers."""

from __future__ import annotations

import argparse

_ARGS: argparse.Namespace | None = None


def set_args(args: argparse.Namespace) -> None:
    global _ARGS
    _ARGS = args


def get_args() -> argparse.Namespace:
    if _ARGS is None:
        raise RuntimeError("get_args() called before pretrain() parsed the arguments")
    return _ARGS
