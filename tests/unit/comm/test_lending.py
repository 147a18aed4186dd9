"""comm/lending.py in one process, on a real one-rank gloo backend (its worker threads hold the works)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp.comm import lending
from megatron_fsdp.comm.lending import on_aliases


@pytest.fixture(scope="module")
def gloo():
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1)


def lent_since(before: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in lending.lent_aliases() if not any(t is e for e in before)]


def test_a_temporary_view_is_lent_as_an_alias_kept_until_the_backend_lets_go(gloo):
    before = lending.lent_aliases()
    buf = torch.arange(8.0)
    view = buf.narrow(0, 2, 4)
    work = on_aliases(lambda t: gloo.allreduce([t]), view)
    (alias,) = lent_since(before)
    assert alias is not view and alias.data_ptr() == view.data_ptr() and alias.shape == view.shape
    del view  # the caller's temporary dies at once, as in the gloo all-gather's broadcasts
    assert lent_since(before), "released while the work still references it"
    work.wait()
    del work
    deadline = time.monotonic() + 5.0
    while lent_since(before) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not lent_since(before), "an alias outlived the work that used it: lending would hold memory for good"
    assert torch.equal(buf, torch.arange(8.0))  # an all-reduce over one rank leaves the values


def test_a_collective_that_raises_lends_nothing(gloo):
    before = lending.lent_aliases()

    def refuse(t: torch.Tensor) -> None:
        raise RuntimeError("refused at issue")

    with pytest.raises(RuntimeError, match="refused at issue"):
        on_aliases(refuse, torch.ones(3))
    assert not lent_since(before)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="the exit guard reads /proc (Linux)")
def test_the_exit_guard_finds_gloo_worker_threads_and_sees_them_go_quiet(gloo):
    work = gloo.allreduce([torch.ones(4)])
    work.wait()
    states = lending.backend_thread_states()
    assert states, (
        f"no thread named {lending.GLOO_WORKER_NAME!r}: torch renamed gloo's worker threads, so the exit "
        "guard of comm/lending.py no longer sees them; update GLOO_WORKER_NAME"
    )
    assert set(states.values()) <= set("RSDTtZXIP"), states
    assert lending.wait_for_quiet_backend_threads(5.0), f"gloo's idle workers never quiet: {states}"
