"""Pending in one process, with stand-in works: no work is forgotten on any error path.

The bug these guard: ``Pending.wait()`` cleared its list before waiting, so one
failing ``wait()`` made the handle forget the other works, and a later ``reshard()``
freed a buffer a broadcast was still writing into (heap corruption, exit 134).
"""

from __future__ import annotations

import pytest

from megatron_fsdp.comm import collectives
from megatron_fsdp.comm.collectives import Pending, _issuing, works_in_flight


class FakeWork:
    """A stand-in for ``dist.Work``: counts its waits, raises ``error`` when given one."""

    def __init__(self, log: list[str], name: str, error: BaseException | None = None) -> None:
        self.log, self.name, self.error = log, name, error
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        self.log.append(self.name)
        if self.error is not None:
            raise self.error
        return True


@pytest.fixture(autouse=True)
def no_leftover_handles():
    before = set(collectives._in_flight)
    yield
    leaked = collectives._in_flight - before
    collectives._in_flight.difference_update(leaked)  # keep later tests independent
    assert not leaked, "a test left a handle registered as in flight"


def test_every_work_is_waited_before_the_first_error_is_raised():
    log: list[str] = []
    first, second, third = (FakeWork(log, "a", RuntimeError("a broke")), FakeWork(log, "b"),
                            FakeWork(log, "c", RuntimeError("c broke")))
    ran = []
    pending = Pending([first, second, third], then=lambda: ran.append(True))
    with pytest.raises(RuntimeError, match="a broke"):
        pending.wait()
    assert log == ["a", "b", "c"]  # the failure did not stop the others being waited for
    assert pending.failed and pending.in_flight and not pending.done and not ran
    assert pending._works == [first, third]  # kept: a failed work may still run
    assert works_in_flight() == 0  # failed handles belong to their owner, not to the in-flight count
    with pytest.raises(RuntimeError, match="failed earlier") as info:
        pending.wait()
    assert info.value.__cause__ is first.error
    assert first.waits == 1 and second.waits == 1 and not ran  # a failed handle never completes


def test_successful_wait_is_idempotent_and_runs_then_once():
    log: list[str] = []
    ran = []
    pending = Pending([FakeWork(log, "a"), FakeWork(log, "b")], then=lambda: ran.append(True))
    assert works_in_flight() == 2 and pending.in_flight and not pending.done
    pending.wait()
    pending.wait()
    assert log == ["a", "b"] and ran == [True]
    assert pending.done and not pending.in_flight and not pending.failed and works_in_flight() == 0
    assert Pending(None).done


def test_an_interrupted_wait_keeps_the_works_not_yet_waited():
    log: list[str] = []
    pending = Pending([FakeWork(log, "a"), FakeWork(log, "b", KeyboardInterrupt()), FakeWork(log, "c")])
    with pytest.raises(KeyboardInterrupt):
        pending.wait()
    assert log == ["a", "b"] and len(pending._works) == 2 and not pending.failed
    assert works_in_flight() == 2  # still owed a wait
    pending._works[0].error = None  # the interrupted work finishes after all
    pending.wait()
    assert log == ["a", "b", "b", "c"] and pending.done


def test_a_then_that_raises_fails_the_handle():
    pending = Pending([FakeWork([], "a")], then=lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        pending.wait()
    assert pending.failed and not pending.in_flight
    with pytest.raises(RuntimeError, match="failed earlier"):
        pending.wait()


def test_an_error_while_issuing_waits_for_the_works_already_issued():
    log: list[str] = []
    pending = Pending()
    with pytest.raises(ValueError, match="third refused") as info:
        with _issuing(pending):
            pending.add(FakeWork(log, "a"))
            pending.add(FakeWork(log, "b"))
            raise ValueError("third refused")
    assert log == ["a", "b"]  # nothing issued is left running behind the error
    assert not pending.in_flight and pending.failed and works_in_flight() == 0
    notes = getattr(info.value, "__notes__", None)
    assert notes is None or "2 work(s) issued before this error were waited for" in notes[0]


def test_an_error_while_issuing_keeps_issued_works_that_fail_to_wait():
    log: list[str] = []
    pending = Pending()
    broken = FakeWork(log, "a", RuntimeError("peer gone"))
    with pytest.raises(ValueError, match="refused"):
        with _issuing(pending):
            pending.add(broken)
            raise ValueError("refused")
    assert pending._works == [broken] and pending.in_flight and pending.failed
    assert isinstance(pending.error, ValueError)
    assert works_in_flight() == 0
