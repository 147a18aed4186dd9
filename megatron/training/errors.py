"""User errors at start-up: a mistake in how the job was launched, reported once and without a traceback.

A ``UsageError`` is a wrong flag combination, a path that does not hold what it
should, a checkpoint that does not fit the flags: its message names the cause and
the fix, so a traceback from every rank would only bury it. ``pretrain_gpt.py``
prints it on rank 0 and exits 1 on every rank (``exit_on_usage_error``); any other
exception is a bug and keeps its traceback. Every ``UsageError`` is raised on all
ranks at the same point (flags are validated on each rank; file checks broadcast
their outcome), so no rank is left waiting in a collective.

The concrete classes also derive from the built-in type the error had before
(``ValueError``, ``FileNotFoundError``, ``RuntimeError``), so callers catching
those keep working.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import NoReturn

EXIT_CODE = 1
# torchrun ends every other rank at the first exit with an error: the other ranks leave this much later, so
# that rank 0 has printed the message before it is ended.
OTHERS_DELAY_S = 2.0


class UsageError(Exception):
    """A start-up mistake of the user's: printed once (rank 0) without a traceback."""


class UsageValueError(UsageError, ValueError):
    """A value (flag, flag combination, checkpoint content) that does not fit."""


class UsageFileNotFoundError(UsageError, FileNotFoundError):
    """A path the flags name holds nothing usable."""


class UsageRuntimeError(UsageError, RuntimeError):
    """The environment cannot do what the flags ask (a directory that cannot be written)."""


def _distributed():
    """``torch.distributed`` when a process group is up, else None (not imported here: the tokenizer, and
    the tools that use it without torch, import this module)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def launch_rank() -> int:
    """This process's rank: the process group's, else torchrun's ``RANK`` (0 when run alone)."""
    dist = _distributed()
    if dist is not None:
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def print_once(message: str, report: str | None = None) -> None:
    """Write ``message`` to stderr on rank 0; the other ranks wait a moment instead (see ``OTHERS_DELAY_S``).

    Under torchrun, rank 0 also leaves the message in its error file, so that torchrun's failure
    report (printed below it) shows the message (or ``report``, the part of it worth repeating) as the
    root cause instead of "To enable traceback".
    """
    if launch_rank() == 0:
        sys.stderr.write(message if message.endswith("\n") else message + "\n")
        sys.stderr.flush()
        _record_for_torchrun((message if report is None else report).rstrip("\n"))
    else:
        time.sleep(OTHERS_DELAY_S)


def _record_for_torchrun(message: str) -> None:
    """torchrun's error-file format for a failure without a traceback: {"message": str, "timestamp": str}."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": str(int(time.time()))}, f)
    except OSError:
        pass  # the report then says less; the message is on stderr already


def exit_on_usage_error(error: UsageError) -> NoReturn:
    """Print ``error`` on rank 0 (stderr, no traceback); leave the process group and exit 1 on every rank."""
    print_once(f"error: {error}")
    gc.collect()  # finished gloo work freed at interpreter exit can abort the process
    dist = _distributed()
    if dist is not None:
        dist.destroy_process_group()
    sys.exit(EXIT_CODE)
