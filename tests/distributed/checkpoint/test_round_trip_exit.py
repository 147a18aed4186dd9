"""DCP round trips between our models and FSDP2's, and our collectives, each run to a normal exit.

Each run spawns 2 fresh gloo ranks running ``round_trip_program``: six runs with the three
exit-race scenarios (``ours``, ``fsdp2``, ``collectives``) in rotation, so each is the last one
before ``destroy_process_group()`` and the exit in 2 runs, and two runs that end with a
background checkpoint save never waited for and no ``destroy_process_group()`` (Megatron-LM's
scripts just return). A rank that raises, dies by a signal or aborts at exit fails the test,
naming the run, and so does a background save the exit cut off (its tracker file missing).
History (issue 25): the FSDP2 round trip failed in 11 of
14 runs before its fix (a cache in torch's DTensor dispatch exchanged our and FSDP2's
placements, docs/design.md section 3); our collectives alone aborted at exit in 2-6 of 20 runs
before lending; the ``ours`` round trip still aborted in 1 of 6 CI runs after it (functional
collectives and object rounds then bypassed lending, docs/api.md "Shutting down").
"""

from __future__ import annotations

import torch.multiprocessing as mp

from megatron_fsdp.checkpoint.iterations import TRACKER_FILE
from tests.distributed.checkpoint import round_trip_program
from tests.distributed.harness import free_port

RACES = ("ours", "fsdp2", "collectives")
# (scenarios, destroy_process_group at the end)
RUNS = [(RACES[i:] + RACES[:i], True) for i in range(3)] * 2 + [(("ours", "async_save"), False)] * 2


def test_round_trips_and_collectives_exit_cleanly_on_every_rank(tmp_path):
    failures = []
    for run, (scenarios, destroy) in enumerate(RUNS):
        directory = tmp_path / f"run{run}"
        directory.mkdir()
        try:
            mp.start_processes(round_trip_program.run, args=(free_port(), scenarios, str(directory), destroy), nprocs=2,
                               start_method="spawn", join=True)
        except mp.ProcessExitedException as error:  # a signal or a non-zero exit, teardown included
            failures.append(f"run {run} {scenarios}: {error}")
        except mp.ProcessRaisedException as error:
            failures.append(f"run {run} {scenarios}: {str(error)[-400:]}")
        else:
            if "async_save" not in scenarios:
                continue
            tracker = directory / "async_save" / TRACKER_FILE
            written = tracker.read_text().strip() if tracker.exists() else "no tracker file"
            if written != str(round_trip_program.ASYNC_ITERATION):
                failures.append(f"run {run} {scenarios}: the background save was not finished at exit ({written})")
    assert not failures, f"{len(failures)} of {len(RUNS)} runs lost a rank:\n" + "\n".join(failures)
