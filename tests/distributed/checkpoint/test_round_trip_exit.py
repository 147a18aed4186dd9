"""DCP round trips between our models and FSDP2's, repeated, every rank's exit status checked (issue 25).

Each run spawns 2 fresh gloo ranks running ``round_trip_program`` to its normal interpreter
exit; a rank that raises, dies by a signal or aborts at exit fails the test. The FSDP2 run
failed in 11 of 14 runs before the fix (a cache in torch's DTensor dispatch exchanged our
and FSDP2's placements, docs/design.md section 3), so 6 runs catch it with probability
above 0.999.
"""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from tests.distributed.checkpoint import round_trip_program
from tests.distributed.harness import free_port

RUNS = 6


@pytest.mark.parametrize("mode", ["fsdp2", "ours"])
def test_round_trips_exit_cleanly_on_every_rank(mode, tmp_path):
    failures = []
    for run in range(RUNS):
        directory = tmp_path / f"run{run}"
        directory.mkdir()
        try:
            mp.start_processes(round_trip_program.run, args=(free_port(), mode, str(directory)), nprocs=2,
                               start_method="spawn", join=True)
        except mp.ProcessExitedException as error:  # a signal or a non-zero exit, teardown included
            failures.append(f"run {run}: {error}")
        except mp.ProcessRaisedException as error:
            failures.append(f"run {run}: {str(error)[-400:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs lost a rank:\n" + "\n".join(failures)


def test_collectives_on_temporaries_exit_cleanly_on_every_rank():
    """comm/lending.py: 8 bare runs of our collectives then exit (2-6 in 20 aborted before lending)."""
    failures = []
    for run in range(8):
        try:
            mp.start_processes(round_trip_program.collectives_then_exit, args=(free_port(),), nprocs=2,
                               start_method="spawn", join=True)
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:
            failures.append(f"run {run}: {str(error)[-400:]}")
    assert not failures, f"{len(failures)} of 8 runs lost a rank:\n" + "\n".join(failures)
