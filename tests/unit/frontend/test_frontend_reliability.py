"""pretrain_gpt.py used carelessly: each mistake fails at start or at the iteration at fault, naming the cause.

The end-to-end cases run the real ``pretrain`` on 2 gloo ranks (one spawned group for all of
them: every failure here is raised on both ranks at the same point, so the group survives it).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import sys
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.training.arguments import parse_args
from megatron.training.indexed_writer import IndexedDatasetBuilder
from tests import ROOT
from tests.distributed.harness import error_on_every_rank, free_port, spawn_and_collect

TINY = ("--mock-data --vocab-size 60 --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --log-interval 2 --use-megatron-fsdp "
        "--data-parallel-sharding-strategy optim_grads_params").split()


def _nan_forward(nan_iterations: set[int] | None):
    """pretrain_gpt's forward_step, with NaN losses in the given iterations (all when None)."""
    from pretrain_gpt import forward_step

    calls = [0]

    def forward(batch, model):
        calls[0] += 1
        iteration = (calls[0] - 1) // 2 + 1  # 8 / (2 x 2 ranks) = 2 micro-batches per iteration
        losses, mask = forward_step(batch, model)
        if nan_iterations is None or iteration in nan_iterations:
            losses = losses * float("nan")
        return losses, mask

    return forward


def _cases(tmp: str) -> dict[str, tuple[list[str], object]]:
    data = [a for a in TINY if a != "--mock-data"]
    return {
        "healthy": ([*TINY, "--split", "100,0,0", "--eval-interval", "2"], None),
        "nan_checked": (TINY, _nan_forward({2})),
        "nan_unchecked_some": ([*TINY, "--no-check-for-nan-in-loss-and-grad"], _nan_forward({2})),
        "nan_unchecked_all": ([*TINY, "--no-check-for-nan-in-loss-and-grad"], _nan_forward(None)),
        "empty_train_split": ([*TINY, "--split", "0,1,0"], None),
        "save_is_a_file": ([*TINY, "--ckpt-format", "fsdp_dtensor", "--save", os.path.join(tmp, "file")], None),
        "ids_beyond_vocab": ([*data, "--data-path", os.path.join(tmp, "wide")], None),
        "truncated_bin": ([*data, "--data-path", os.path.join(tmp, "cut")], None),
        # the same model at TP 1 and TP 2 (both pad the vocabulary to 64): one whole-model parameter count
        "vocab32": ([*TINY, "--make-vocab-size-divisible-by", "32", "--train-iters", "1"], None),
        "vocab32_tp2": ([*TINY, "--make-vocab-size-divisible-by", "32", "--train-iters", "1",
                         "--tensor-model-parallel-size", "2"], None),
        "no_vocab_size": ([a for a in TINY if a not in ("--vocab-size", "60")], None),
    }


def _worker(rank: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    import contextlib
    import io

    from megatron.training.training import pretrain
    from pretrain_gpt import forward_step, model_provider

    results = {}
    for name, (argv, forward) in _cases(tmp).items():
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                run = pretrain(model_provider, forward or forward_step, argv)
            results[name] = {"losses": {str(k): v for k, v in run.losses.items()}, "iteration": run.iteration}
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
        results[name]["log"] = log.getvalue()
        dist.barrier()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _write_dataset(prefix: str, high: int) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(300):
        builder.add_item(rng.integers(0, high, size=30).tolist())
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """Every case's outcome on each rank: {"error": ...} or {"losses": ..., "iteration": ...}, plus "log"."""
    tmp = str(tmp_path_factory.mktemp("reliability"))
    open(os.path.join(tmp, "file"), "w").close()
    _write_dataset(os.path.join(tmp, "wide"), 100)  # ids of a 100-token vocabulary; the runs say --vocab-size 60
    _write_dataset(os.path.join(tmp, "cut"), 60)
    with open(os.path.join(tmp, "cut.bin"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(tmp, "cut.bin")) - 10)
    return spawn_and_collect(_worker, tmp)


def test_healthy_run_reports_a_nonzero_throughput(runs):
    log = runs[-1]["healthy"]["log"]  # the training log is printed by the last rank, as Megatron
    figures = [float(x) for x in re.findall(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.e+-]+) \|", log)]
    assert len(figures) == 2 and all(0 < x < 1 for x in figures), log  # a CPU run: well under 1 TFLOP/s
    assert runs[0]["healthy"]["iteration"] == 4
    # the learning rate logged is the one after the schedule's step, as Megatron logs it (linear decay over 4)
    assert "iteration        2/       4 |" in log and "learning rate: 5.000000E-04 |" in log
    assert "WARNING: --eval-interval 2 is given but --split 100,0,0 leaves the validation split" in \
        runs[0]["healthy"]["log"]


def test_nan_loss_fails_at_its_iteration(runs):
    error = error_on_every_rank(runs, "nan_checked")
    assert error.startswith("NonFiniteLossError: iteration 2: lm loss nan"), error
    assert "--lr" in error and "--no-check-for-nan-in-loss-and-grad" in error


def test_unchecked_nan_iterations_are_skipped_and_counted(runs):
    run = runs[-1]["nan_unchecked_some"]
    assert run["iteration"] == 4 and math.isnan(run["losses"]["2"]) and math.isfinite(run["losses"]["4"])
    lines = [line for line in run["log"].splitlines() if "iteration " in line]
    assert "number of skipped iterations:   1 | number of nan iterations:   1 |" in lines[0]
    assert "number of skipped iterations:   0 | number of nan iterations:   0 |" in lines[1]
    assert "lm loss: NAN" not in lines[0]  # the window mean is over the iterations that stepped, as Megatron


def test_all_iterations_skipped_is_an_error(runs):
    error = error_on_every_rank(runs, "nan_unchecked_all")
    assert error.startswith("NonFiniteLossError: all 4 iterations (1 to 4) were skipped"), error


def test_empty_train_split_names_split(runs):
    error = error_on_every_rank(runs, "empty_train_split")
    assert "--split 0,1,0 leaves the train split of --mock-data without documents" in error, error


def test_unusable_save_dir_fails_at_start(runs):
    error = error_on_every_rank(runs, "save_is_a_file")
    assert re.search(r"--save \S+/file cannot hold checkpoints \(rank 0: NotADirectoryError", error), error
    assert "iteration" not in runs[0]["save_is_a_file"]["log"]  # before any training


def test_token_ids_beyond_vocab_name_the_tokenizer(runs):
    error = error_on_every_rank(runs, "ids_beyond_vocab")
    assert "(train split): token id" in error and "outside the tokenizer's vocabulary [0, 61)" in error, error


def test_truncated_data_fails_at_start(runs):
    error = error_on_every_rank(runs, "truncated_bin")
    assert re.search(r"cut\.bin is truncated or corrupt", error), error
    assert "number of parameters" not in runs[0]["truncated_bin"]["log"]  # found before the model is built


def test_timeout_flag_reaches_the_process_group(monkeypatch):
    from megatron.training import initialize

    seen = {}
    monkeypatch.setattr(initialize.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(initialize.dist, "init_process_group", lambda backend, timeout: seen.update(t=timeout))
    monkeypatch.setenv("RANK", "0")
    args = parse_args(["--mock-data", "--distributed-timeout-minutes", "3", "--distributed-backend", "gloo"])
    initialize.initialize_distributed(args)
    assert seen["t"] == datetime.timedelta(minutes=3)


def test_a_plain_single_process_run_binds_no_port(monkeypatch):
    """``python pretrain_gpt.py`` without torchrun: an in-memory store, so two such runs never clash on a port."""
    from megatron.training import initialize

    seen = {}
    monkeypatch.setattr(initialize.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(initialize.dist, "init_process_group", lambda backend, **kwargs: seen.update(kwargs))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    initialize.initialize_distributed(parse_args(["--mock-data", "--distributed-backend", "gloo"]))
    assert isinstance(seen["store"], initialize.dist.HashStore) and (seen["rank"], seen["world_size"]) == (0, 1)
    assert "MASTER_PORT" not in os.environ


def test_tensorboard_warning_printed_where_the_writer_would_be(monkeypatch, capsys):
    from megatron.training.training import _tensorboard_writer

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    args = parse_args(["--mock-data", "--tensorboard-dir", "tb"])
    assert _tensorboard_writer(args, 0, 2) is None
    assert capsys.readouterr().out == ""
    assert _tensorboard_writer(args, 1, 2) is None
    assert "[Rank 1] WARNING: --tensorboard-dir tb given but tensorboard is not installed" in capsys.readouterr().out


def test_save_dir_check_single_process(tmp_path):
    from megatron.training.initialize import check_save_dir

    check_save_dir(str(tmp_path / "new" / "dir"))
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())
    (tmp_path / "f").write_text("")
    with pytest.raises(RuntimeError, match=r"--save .*f/sub cannot hold checkpoints .*NotADirectoryError"):
        check_save_dir(str(tmp_path / "f" / "sub"))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(RuntimeError, match="PermissionError"):
            check_save_dir(str(locked))


def test_cli_exit_code_when_every_iteration_is_skipped():
    """The command line, not only pretrain(): a run that trained nothing must not exit 0."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    argv = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--mock-data", "--vocab-size", "60",
            "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--train-iters", "2", "--init-method-std", "1e30", "--no-check-for-nan-in-loss-and-grad"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout
    assert "NonFiniteLossError: all 2 iterations (1 to 2) were skipped" in done.stderr, done.stderr[-3000:]


def _line(log: str, start: str) -> str:
    lines = [line for line in log.splitlines() if line.startswith(start)]
    assert len(lines) == 1, (start, log)
    return lines[0]


def _kib(figure: str) -> float:
    number, unit = figure.split()
    return float(number) * {"KiB": 1, "MiB": 1024, "GiB": 1 << 20}[unit]


def test_startup_and_end_of_run_summaries(runs):
    log, run = runs[0]["healthy"]["log"], runs[0]["healthy"]
    assert _line(log, "world size:") == "world size: 2 = data-parallel 2 x context-parallel 1 x tensor-parallel 1"
    assert _line(log, "mesh:") == "mesh: (dp_shard=2, tp=1)"
    assert _line(log, "data parallelism:") == "data parallelism: megatron_fsdp optim_grads_params (ZeRO-3) over 2 ranks"
    assert _line(log, "batch:") == ("batch: global 8 = micro-batch 2 x data-parallel 2 x 2 micro-batches per step; "
                                    "sequence length 16")
    slice_count = int(_line(log, " > number of parameters on").rsplit(":", 1)[1])
    params = _line(log, "parameters:")
    assert params == f"parameters: {slice_count:,} (the whole model); weights fp32"  # TP 1: the slice is all
    # ZeRO-3 in fp32 on 2 ranks: half the weights, gradients and two Adam states each, 4 bytes, plus padding
    memory = re.fullmatch(r"memory estimate per rank \(megatron_fsdp\.plan; activations not included\): "
                          r"(\S+ \S+) between steps \(weights (\S+ \S+) \+ gradients (\S+ \S+) \+ Adam state "
                          r"(\S+ \S+)\); gathered weights in forward/backward (\S+ \S+)",
                          _line(log, "memory estimate"))
    assert memory, _line(log, "memory estimate")
    resident, weights, grads, adam, _ = (_kib(g) for g in memory.groups())
    half = slice_count / 2 * 4 / 1024
    assert half <= weights < 1.05 * half and half <= grads < 1.05 * half and 2 * half <= adam < 1.05 * 2 * half
    assert abs(resident - (weights + grads + adam)) < 0.2
    assert _line(log, "training 4 iterations") == "training 4 iterations; checkpoints: none (no --save)"
    end, loss = _line(log, "end of training:"), re.escape(f"{run['losses']['4']:.6E}")
    assert re.fullmatch(r"end of training: 4 iterations \(1 to 4\) \| 32 samples, 512 tokens \| [0-9.]+ s \| "
                        rf"final lm loss: {loss} \| checkpoint: none \(no --save\)", end), end
    assert "set-up" not in runs[1]["healthy"]["log"] and "end of training" not in runs[1]["healthy"]["log"]


def test_whole_model_parameter_count_does_not_depend_on_tensor_parallelism(runs):
    tp1, tp2 = runs[0]["vocab32"]["log"], runs[0]["vocab32_tp2"]["log"]
    whole = _line(tp1, "parameters:").split()[1]
    assert _line(tp2, "parameters:").split()[1] == whole
    assert "(the whole model, over every tensor-/expert-parallel slice)" in _line(tp2, "parameters:")
    assert int(_line(tp2, " > number of parameters on").rsplit(":", 1)[1]) < int(whole.replace(",", ""))
    assert _line(tp2, "world size:") == "world size: 2 = data-parallel 1 x context-parallel 1 x tensor-parallel 2"
    assert "x 4 micro-batches per step" in _line(tp2, "batch:")


def test_missing_vocab_size_names_the_flag(runs):
    error = error_on_every_rank(runs, "no_vocab_size")
    assert error.startswith("UsageValueError: give --vocab-size N: the number of token ids"), error
