"""pretrain_gpt.py's --save/--load used carelessly: each mistake fails at start on every rank, naming the cause.

The cases run the real ``pretrain`` one after another in one spawned 2-rank gloo group
(every failure here is raised on both ranks at the same point, so the group survives
it); between cases rank 0 damages or copies checkpoint directories.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
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
    return [
        ("save", [*TINY, "--train-iters", "4", "--save", save, "--save-interval", "2"], None),
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
            results[name] = {"losses": {str(k): v for k, v in run.losses.items()}}
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
