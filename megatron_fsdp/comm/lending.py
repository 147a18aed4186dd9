"""Tensors handed to a collective stay referenced from Python until the backend has let go of them.

Why (issue 25, item 1: "terminate called without an active exception", SIGABRT after a
program's last line): a gloo worker thread keeps its own reference to each work, and so to
the work's tensors, until just *after* it marked the work complete, i.e. possibly after
``wait()`` returned in the main thread. If the main thread has meanwhile dropped the tensor's
Python object (a temporary such as ``buf.narrow(...)``, or a caller's tensor that went out of
scope), torch keeps that object alive inside the tensor, and the worker, now holding the last
reference, must take the GIL to release it. While the main thread finalizes the interpreter a
thread asking for the GIL is ended with ``pthread_exit``, whose unwinding through gloo's
``noexcept`` frames is ``std::terminate``. Seen in a core file (``ProcessGroupGloo::runLoop ->
~AsyncAllreduceWork -> decref_pyobject -> take_gil -> pthread_exit``) and reproduced with
plain torch: twenty rounds of async broadcasts of temporary views, waited for, then
``destroy_process_group()`` and exit, aborted in 10 of 80 runs on a busy 2-core machine (2 to 6
in three batches of 20, none in a fourth); the same broadcasts of a tensor kept alive, 0 of 20.

So every tensor the engine passes to ``torch.distributed`` is a fresh alias (``detach()``: same
storage, no autograd, holds no reference to the original tensor object) that this module
references from the moment it was issued until its use count says no backend thread holds it
any more. Dropping it then happens on the main thread, with the GIL. Aliases are returned at every later collective
issued here and every ``return_lent`` (cheap: a use-count read per alias; there are a handful per collective), and at
interpreter exit an ``atexit`` handler, which runs while other threads may still take the
GIL, waits until every backend thread has let go (at most ``EXIT_WAIT_S``: a work never
waited for, as on an error path, holds its aliases for good, and a hung backend must not hang
the exit). An alias shares its tensor's storage, so memory freed by resizing a storage to 0 is
freed at once; a storage otherwise freed by dropping its last tensor outlives it until the next
collective is issued or waited for.

Collectives torch issues inside its own helpers (DCP's planning rounds, ``all_gather_object``;
the library and the front-end use ``comm/objects.py`` instead, and eager ``full_tensor()`` of a
ragged shard goes through here) are outside lending's reach. For those, the exit handler also
waits, after the lent aliases, until no gloo worker thread (torch names them
``pt_gloo_runloop``) is runnable: such a thread, between completing a work and dropping it, is
either running or waiting for the CPU; once every one sleeps (on its queue, a peer, or the GIL,
which the waiting loop keeps releasing) two polls running, it has let go of whatever it held.
Linux only (``/proc/self/task``); elsewhere only the lent aliases are waited for. Measured with
plain torch (object collectives, then exit; 2 ranks on the loaded 2-core machine): 2 aborts in
about 130 runs without this wait, none in about 125 with it.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_lent: list[torch.Tensor] = []
# Collectives are also issued from other threads (a background checkpoint write): pruning rebuilds the
# list, which must not lose an alias another thread appends meanwhile.
_lent_lock = threading.Lock()
R = TypeVar("R")

# The longest the exit handler waits for lent tensors to be released: a backend thread lets go of a
# work microseconds after completing it, so only a work never waited for (or a hung one) lasts this long.
EXIT_WAIT_S = 2.0


def on_aliases(collective: Callable[..., R], *tensors: torch.Tensor, **kwargs: Any) -> R:
    """``collective(*aliases of tensors, **kwargs)``; the aliases stay referenced here until released.

    An alias joins the list only once the collective was issued, so pruning (which drops every
    alias nothing else references) never drops one between its creation and its issue.
    """
    aliases = [t.detach() for t in tensors]
    result = collective(*aliases, **kwargs)
    return_lent()
    with _lent_lock:
        _lent.extend(aliases)
    return result


def wait_lent(collective: Callable[..., Any], *tensors: torch.Tensor, **kwargs: Any) -> None:
    """``collective(*aliases, **kwargs, async_op=True).wait()`` (``on_aliases``), then return what was let go."""
    on_aliases(collective, *tensors, async_op=True, **kwargs).wait()
    return_lent()


def _held_elsewhere(alias: torch.Tensor) -> bool:
    # Our Python object accounts for one reference; any other is a work or backend thread's.
    return alias._use_count() > 1


def return_lent() -> None:
    """Drop the aliases that no work or backend thread references any more."""
    if _lent:
        with _lent_lock:
            _lent[:] = [t for t in _lent if _held_elsewhere(t)]


def lent_aliases() -> list[torch.Tensor]:
    """The aliases some work or backend thread still references (none once every issued work was released)."""
    return_lent()
    with _lent_lock:
        return list(_lent)


GLOO_WORKER_NAME = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
_TASKS = "/proc/self/task"


def backend_thread_states() -> dict[int, str]:
    """Each gloo worker thread of this process (by thread id) and its scheduler state ("R", "S", ...).

    Empty where ``/proc`` is missing (not Linux) or no gloo group was made.
    """
    states: dict[int, str] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return states
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name == GLOO_WORKER_NAME:
            states[int(tid)] = stat[stat.rindex(")") + 2]
    return states


def _backend_threads_busy() -> bool:
    # R: running or waiting for a CPU; D: uninterruptible. Anything else is asleep.
    return any(state in "RD" for state in backend_thread_states().values())


def wait_for_quiet_backend_threads(timeout_s: float) -> bool:
    """Wait until no gloo worker thread is runnable at two polls in a row; False if ``timeout_s`` ran out."""
    deadline = time.monotonic() + timeout_s
    quiet_polls = 0
    while quiet_polls < 2:
        quiet_polls = 0 if _backend_threads_busy() else quiet_polls + 1
        if quiet_polls < 2:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)  # releases the GIL, which a worker may be waiting for
    return True


def _wait_for_release_at_exit() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    while lent_aliases() and time.monotonic() < deadline:
        time.sleep(0.001)
    wait_for_quiet_backend_threads(max(0.0, deadline - time.monotonic()))


atexit.register(_wait_for_release_at_exit)
