"""Single-process checkpoint pieces: safetensors streaming, save/load without a process group, the CLI."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from megatron_fsdp.checkpoint import load_checkpoint, save_checkpoint
from megatron_fsdp.checkpoint.cli import main
from megatron_fsdp.checkpoint.export import export_full_state_dict, import_full_state_dict
from megatron_fsdp.checkpoint.safetensors_stream import SafetensorsWriter, TensorSpec, read_header, read_tensor
from megatron_fsdp.checkpoint.sharded_io import load_state, save_state
from megatron_fsdp.checkpoint.state_dicts import CheckpointMismatchError
from tests import ROOT
from tests.models import Net, global_batch, loss_fn


def test_safetensors_round_trip_and_layout(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b.bf16": torch.randn(4).to(torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
    }
    path = str(tmp_path / "x.safetensors")
    writer = SafetensorsWriter(path, [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    raw = open(path, "rb").read()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0
    header = json.loads(raw[8:8 + length])
    assert header["a"] == {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 60]}
    assert len(raw) == 8 + length + sum(v.numel() * v.element_size() for v in tensors.values())
    parsed, start = read_header(path)
    for k, v in tensors.items():
        assert torch.equal(read_tensor(path, parsed[k], start), v), k
    try:
        from safetensors.torch import load_file
    except ImportError:
        return
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_safetensors_writer_rejects_out_of_order(tmp_path):
    writer = SafetensorsWriter(str(tmp_path / "y.safetensors"), [TensorSpec("a", torch.float32, (2,))])
    with pytest.raises(ValueError, match="expected 'a' next"):
        writer.write("b", torch.zeros(2))
    with pytest.raises(ValueError, match="closed before"):
        writer.close()


def _train(model, opt, steps):
    for step in steps:
        loss_fn(model, global_batch(step, 1, per_rank=4)).backward()
        opt.step()
        opt.zero_grad()


def test_save_load_without_process_group_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    straight = Net()
    torch.manual_seed(0)
    resumed = Net()
    opt_a, opt_b = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (straight, resumed))
    _train(straight, opt_a, range(4))
    _train(resumed, opt_b, range(2))
    save_state(str(tmp_path / "c"), resumed, opt_b)
    torch.manual_seed(3)
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    load_state(str(tmp_path / "c"), fresh, fresh_opt)
    _train(fresh, fresh_opt, range(2, 4))
    for (name, p), q in zip(straight.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
    # 6 unexpected keys: the first five are named, and the count of the rest
    with pytest.raises(CheckpointMismatchError, match=r"6 unexpected .*model.blocks.2.down.bias, .*\(1 more\)"):
        load_state(str(tmp_path / "c"), Net(layers=2))


def test_megatron_layout_and_cli_export(tmp_path, capsys):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(1))
    save_dir = str(tmp_path / "run")
    path = save_checkpoint(save_dir, 10, model, opt, {"consumed_samples": 40})
    assert os.path.basename(path) == "iter_0000010"
    loaded = load_checkpoint(save_dir, Net(), torch.optim.AdamW(Net().parameters()), load_optimizer=False)
    assert loaded.iteration == 10 and loaded.extra == {"consumed_samples": 40} and loaded.rng_restored
    env = dict(os.environ, PYTHONPATH=ROOT)
    for ext in ("safetensors", "pt"):
        out = str(tmp_path / f"model.{ext}")
        argv = ["export", "--checkpoint", save_dir, "--output", out]
        if ext == "safetensors":  # the real entry point once; in-process otherwise (start-up is slow)
            done = subprocess.run([sys.executable, "-m", "megatron_fsdp.checkpoint", *argv], env=env,
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
        else:
            assert main(argv) == 0
        torch.manual_seed(5)
        fresh = Net()
        assert not import_full_state_dict(out, fresh)
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(p, q), (ext, name)
    assert main(["info", "--checkpoint", path]) == 0
    assert "model.embed.weight\tfloat32\t(17, 13)" in capsys.readouterr().out
    assert main(["export", "--checkpoint", str(tmp_path / "none"), "--output", "x.safetensors"]) == 2
    assert "no .metadata" in capsys.readouterr().err
    with pytest.raises(ValueError, match=".safetensors"):
        export_full_state_dict(path, str(tmp_path / "model.bin"))


def test_a_background_save_that_failed_unwaited_is_reported_at_exit(capsys):
    """``AsyncSave``: a failed write nobody waited for is named on stderr at exit, with the fix."""
    from megatron_fsdp.checkpoint import iterations

    class FailingWrite:
        save_dir, iteration = "/nowhere/ckpt", 7

        def write(self, entries, io_group):
            raise RuntimeError("Invalid process group specified")

    pending = iterations.AsyncSave(FailingWrite(), {}, None)
    assert pending._thread.daemon is False  # the interpreter finishes a write before exiting
    pending._thread.join()
    iterations._report_failed_saves_not_waited_for()
    err = capsys.readouterr().err
    assert "iteration 7 into /nowhere/ckpt FAILED" in err and "AsyncSave.wait() before" in err, err
    with pytest.raises(RuntimeError, match="Invalid process group"):
        pending.wait()
    iterations._report_failed_saves_not_waited_for()
    assert capsys.readouterr().err == "", "a save that was waited for is not reported again"
