"""pretrain_gpt.py's --save/--load used carelessly: each mistake fails at start on every rank, naming the cause.

The cases run the real ``pretrain`` one after another in one spawned 2-rank gloo group
(every failure here is raised on both ranks at the same point, so the group survives
it); between cases rank 0 damages or copies checkpoint directories. The learning-rate
schedule follows Megatron-LM's rule at resume: the save plans its decay over 6 iterations
(``--lr-decay-iters 6``) so that resuming to ``--train-iters 6`` keeps the same schedule;
a resume with other schedule flags is refused unless one of the two override flags says
which schedule wins.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import re
import shutil
import traceback

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import error_on_every_rank, spawn_and_collect

TINY = ("--mock-data --vocab-size 60 --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --log-interval 1 --use-megatron-fsdp "
        "--data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor").split()


def _cases(tmp: str) -> list[tuple[str, list[str], object]]:
    """(name, flags, what rank 0 does to the files first)."""
    save, wrong = os.path.join(tmp, "run"), os.path.join(tmp, "rnu")

    def copy_without(name: str, part: str):
        def prepare() -> None:
            shutil.copytree(save, os.path.join(tmp, name))
            os.remove(os.path.join(tmp, name, "iter_0000004", part))
        return prepare

    def copy_and_damage() -> None:
        shutil.copytree(save, os.path.join(tmp, "damaged"))
        shard = os.path.join(tmp, "damaged", "iter_0000004", "__1_0.distcp")
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            f.write(b"\x00" * 256)

    resume = [*TINY, "--load", save, "--train-iters", "6"]
    changed = [*resume, "--lr", "3e-3", "--lr-decay-style", "cosine"]
    return [
        ("save", [*TINY, "--train-iters", "4", "--lr-decay-iters", "6", "--save", save, "--save-interval", "2"],
         None),
        ("load_wrong_path", [*TINY, "--train-iters", "6", "--load", wrong, "--save", save], None),
        ("load_wrong_path_fresh", [*TINY, "--train-iters", "1", "--load", wrong, "--allow-fresh-start"], None),
        ("save_behind_tracker", [*TINY, "--train-iters", "2", "--save", save], None),
        ("heads_changed", [*resume, "--num-attention-heads", "8"], None),
        ("vocab_changed", [*resume, "--vocab-size", "100"], None),
        ("heads_changed_unchecked", [*resume, "--num-attention-heads", "8", "--no-load-args-check"], None),
        ("missing_extra", [*TINY, "--train-iters", "6", "--load", os.path.join(tmp, "no_extra")],
         copy_without("no_extra", "extra.pt")),
        ("damaged_shard", [*TINY, "--train-iters", "6", "--load", os.path.join(tmp, "damaged")], copy_and_damage),
        ("resume", resume, None),
        ("schedule_changed", changed, None),
        ("schedule_changed_override", [*changed, "--override-opt_param-scheduler"], None),
        ("schedule_changed_use_checkpoint", [*changed, "--use-checkpoint-opt_param-scheduler"], None),
        ("finished", [*TINY, "--load", save, "--train-iters", "4", "--lr-decay-iters", "6"], None),
        ("iteration_dir", [*TINY, "--load", os.path.join(save, "iter_0000002"), "--train-iters", "4",
                           "--lr-decay-iters", "6"], None),
        ("iteration_dir_missing", [*TINY, "--load", os.path.join(save, "iter_0000003"), "--train-iters", "4"],
         None),
    ]


def _worker(rank: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    from megatron.training.training import pretrain
    from pretrain_gpt import forward_step, model_provider

    results = {}
    for name, argv, prepare in _cases(tmp):
        if prepare is not None and rank == 0:
            prepare()
        dist.barrier()
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                run = pretrain(model_provider, forward_step, argv)
            results[name] = {"losses": {str(k): v for k, v in run.losses.items()}, "iteration": run.iteration}
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
        results[name]["log"] = log.getvalue()
        results[name]["tracker"] = open(os.path.join(tmp, "run", "latest_checkpointed_iteration.txt")).read()
        dist.barrier()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return spawn_and_collect(_worker, str(tmp_path_factory.mktemp("checkpoint-frontend")))


def _trained(runs: list[dict], name: str) -> list[int]:
    assert "error" not in runs[0][name], runs[0][name].get("trace")
    return sorted(int(k) for k in runs[0][name]["losses"])


def test_load_of_a_path_without_checkpoint_fails_unless_fresh_start_allowed(runs):
    assert _trained(runs, "save") == [1, 2, 3, 4]
    error = error_on_every_rank(runs, "load_wrong_path")
    assert "FileNotFoundError: --load" in error and "rnu does not exist" in error, error
    assert "--allow-fresh-start" in error, error
    assert runs[0]["load_wrong_path"]["tracker"].strip() == "4"  # the real checkpoint was not touched
    assert _trained(runs, "load_wrong_path_fresh") == [1]
    assert "training from scratch (--allow-fresh-start)" in runs[0]["load_wrong_path_fresh"]["log"]


def test_a_run_whose_saves_would_move_the_tracker_back_fails_at_start(runs):
    error = error_on_every_rank(runs, "save_behind_tracker")
    assert "already holds a checkpoint of iteration 4" in error and "starts at iteration 0" in error, error
    assert " iteration " not in runs[0]["save_behind_tracker"]["log"]  # before any training
    assert runs[0]["save_behind_tracker"]["tracker"].strip() == "4"


def test_other_model_arguments_with_equal_shapes_are_refused(runs):
    error = error_on_every_rank(runs, "heads_changed")
    assert "--num-attention-heads 4 (saved) vs 8 (now)" in error and "--no-load-args-check" in error, error
    error = error_on_every_rank(runs, "vocab_changed")
    assert "--vocab-size 60 (saved) vs 100 (now)" in error, error
    assert "--padded-vocab-size" not in error  # both pad to 128: only the flag the user changed
    assert _trained(runs, "heads_changed_unchecked") == [5, 6]


def test_missing_or_damaged_parts_are_errors_naming_the_file(runs):
    error = error_on_every_rank(runs, "missing_extra")
    assert "CheckpointIncompleteError" in error and "no_extra/iter_0000004/extra.pt is missing" in error, error
    error = error_on_every_rank(runs, "damaged_shard")
    assert "CheckpointCorruptError" in error and "iter_0000004/__1_0.distcp does not match its SHA-256" in error


def test_resume_continues_data_position(runs):
    assert _trained(runs, "resume") == [5, 6]
    assert "| consumed samples:           40 |" in runs[-1]["resume"]["log"], runs[-1]["resume"]["log"]


def _learning_rates(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"learning rate: ([0-9.E+-]+) \|", log)]


def test_a_changed_schedule_is_refused_unless_a_flag_says_which_wins(runs):
    error = error_on_every_rank(runs, "schedule_changed")
    assert error.startswith("UsageValueError: --load "), error
    assert "--lr 0.001 (saved) vs 0.003 (now)" in error and "--lr-decay-style linear (saved) vs cosine (now)" in error
    assert "--override-opt_param-scheduler" in error and "--use-checkpoint-opt_param-scheduler" in error
    # override: this run's schedule (cosine from 3e-3 to 0 over 6), at the checkpoint's step
    assert _trained(runs, "schedule_changed_override") == [5, 6]
    cosine = [3e-3 * 0.5 * (math.cos(math.pi * step / 6) + 1) for step in (5, 6)]
    assert _learning_rates(runs[-1]["schedule_changed_override"]["log"]) == pytest.approx(cosine, rel=1e-6, abs=1e-12)
    # use-checkpoint: the saved schedule (linear from 1e-3 to 0 over 6) continues; the flags are ignored
    assert _trained(runs, "schedule_changed_use_checkpoint") == [5, 6]
    linear = [1e-3 * (1 - step / 6) for step in (5, 6)]
    log = runs[-1]["schedule_changed_use_checkpoint"]["log"]
    assert _learning_rates(log) == pytest.approx(linear, rel=1e-6, abs=1e-12)


def test_a_resume_with_nothing_left_to_train_says_so(runs):
    run = runs[0]["finished"]
    assert "error" not in run and run["iteration"] == 4 and run["losses"] == {}, run
    lines = [line for line in run["log"].splitlines() if "nothing to train" in line]
    assert len(lines) == 1 and re.fullmatch(
        r"--load \S+/run is at iteration 4 and --train-iters is 4: nothing to train\. To train further, raise "
        r"--train-iters \(see docs/megatron\.md, Resuming\)", lines[0]), run["log"]


def test_load_of_an_iteration_directory_loads_that_iteration(runs):
    """--load DIR/iter_0000002 resumes at 2 and retraces the saving run's iterations 3 and 4, bitwise."""
    assert _trained(runs, "iteration_dir") == [3, 4]
    assert "successfully loaded checkpoint from" in runs[0]["iteration_dir"]["log"]
    for it in ("3", "4"):
        assert runs[0]["iteration_dir"]["losses"][it] == runs[0]["save"]["losses"][it]
    error = error_on_every_rank(runs, "iteration_dir_missing")
    assert "iter_0000003 does not exist" in error and "Give the save directory" in error, error
