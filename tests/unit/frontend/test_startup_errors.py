"""User errors at start-up: one message from rank 0, no traceback, a non-zero exit on every rank.

``pretrain_gpt.py`` is launched as torchrun launches it (two processes with ``RANK``,
``WORLD_SIZE``, ...), every case at once, and each rank's exit code and output are
checked: a flag typo (argparse's usage once, with "did you mean"), a bad flag
combination, a ``--save`` that holds a later checkpoint, a ``--load`` that does not
exist. A bug (any other exception) keeps its traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.training.arguments import parse_args
from megatron.training.errors import UsageValueError
from tests import ROOT
from tests.distributed.harness import free_port

TINY = ("--mock-data --vocab-size 60 --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 2").split()


def _cases(tmp: str) -> dict[str, tuple[list[str], int, str]]:
    """name -> (flags, exit code of every rank, what rank 0 alone prints on stderr)."""
    return {
        "typo": ([*TINY, "--lrr", "3e-3"], 2, "--lrr: did you mean --lr?"),
        "bad_combination": ([*TINY, "--fp16"], 1, "error: --fp16 is not supported by this front-end; use --bf16"),
        "existing_checkpoint": ([*TINY, "--save", os.path.join(tmp, "ckpt")], 1,
                                f"error: --save {tmp}/ckpt already holds a checkpoint of iteration 60"),
        "wrong_load": ([*TINY, "--load", os.path.join(tmp, "nope")], 1, f"error: --load {tmp}/nope does not exist"),
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, list[subprocess.CompletedProcess]]:
    tmp = str(tmp_path_factory.mktemp("startup-errors"))
    os.makedirs(os.path.join(tmp, "ckpt"))
    with open(os.path.join(tmp, "ckpt", "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("60\n")
    running = {}
    for name, (flags, _, _) in _cases(tmp).items():
        port = str(free_port())
        running[name] = []
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                   "TORCHELASTIC_ERROR_FILE": os.path.join(tmp, f"{name}-{rank}.json")}  # as torchrun sets it
            running[name].append(subprocess.Popen(
                [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags], cwd=tmp, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = {}
    for name, procs in running.items():
        done[name] = []
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            done[name].append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return {"tmp": tmp, **done}


@pytest.mark.parametrize("name", ["typo", "bad_combination", "existing_checkpoint", "wrong_load"])
def test_user_error_is_printed_once_and_every_rank_exits_non_zero(launched, name):
    _, code, message = _cases(launched["tmp"])[name]
    rank0, rank1 = launched[name]
    context = f"rank 0 stderr:\n{rank0.stderr[-3000:]}\nrank 1 stderr:\n{rank1.stderr[-3000:]}"
    assert (rank0.returncode, rank1.returncode) == (code, code), context
    assert rank0.stderr.count(message) == 1, context
    assert message not in rank1.stderr and "error:" not in rank1.stderr, context
    for proc in (rank0, rank1):
        assert "Traceback" not in proc.stderr, context
        assert "set-up" not in proc.stdout  # stopped before training
    # torchrun's failure report shows rank 0's error file as the root cause: the message, not a traceback
    with open(os.path.join(launched["tmp"], f"{name}-0.json")) as f:
        report = json.load(f)["message"]
    assert message in report and "Traceback" not in report and "usage:" not in report, report
    assert not os.path.exists(os.path.join(launched["tmp"], f"{name}-1.json"))


def test_flag_typo_prints_the_usage_once(launched):
    rank0, rank1 = launched["typo"]
    assert rank0.stderr.startswith("usage: pretrain_gpt.py") and rank0.stderr.count("usage:") == 1, rank0.stderr
    assert rank0.stderr.rstrip().endswith("pretrain_gpt.py: error: unrecognized arguments: --lrr 3e-3\n"
                                          "  --lrr: did you mean --lr?"), rank0.stderr[-500:]
    assert rank1.stderr == ""


def test_did_you_mean_for_each_close_flag(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--mock-data", "--data-parallel-sharding-stratgy", "optim", "--hiden-size=8", "--zzz"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--data-parallel-sharding-stratgy: did you mean --data-parallel-sharding-strategy?" in err
    assert "--hiden-size: did you mean --hidden-size?" in err
    assert "--zzz:" not in err  # nothing close: no suggestion


def test_a_bug_keeps_its_traceback_and_a_usage_error_exits_1(monkeypatch, capsys):
    import pretrain_gpt

    monkeypatch.delenv("RANK", raising=False)

    def bug(*_):
        raise KeyError("a bug")

    monkeypatch.setattr(pretrain_gpt, "pretrain", bug)
    with pytest.raises(KeyError):
        pretrain_gpt.main([])

    def mistake(*_):
        raise UsageValueError("--x is wrong: pass --y")

    monkeypatch.setattr(pretrain_gpt, "pretrain", mistake)
    with pytest.raises(SystemExit) as info:
        pretrain_gpt.main([])
    assert info.value.code == 1
    assert capsys.readouterr().err == "error: --x is wrong: pass --y\n"
