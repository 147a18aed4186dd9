"""Damaged, incomplete and interrupted checkpoints (single process): every problem is an error naming the file.

Covers the SHA-256 manifest, missing parts, garbage in each file kind, the tracker
never moving back, the clean-up of interrupted saves, the safe replacement of an
existing iteration, and SIGKILL at random points of a save.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from megatron_fsdp.checkpoint import (
    TRACKER_FILE,
    CheckpointCorruptError,
    CheckpointIncompleteError,
    iteration_dir,
    load_checkpoint,
    save_checkpoint,
)
from megatron_fsdp.checkpoint import dirs as checkpoint_dirs
from megatron_fsdp.checkpoint.cli import main as cli
from megatron_fsdp.checkpoint.integrity import MANIFEST_FILE, file_digest
from megatron_fsdp.checkpoint.sharded_io import load_state, save_state
from tests import ROOT
from tests.models import Net, global_batch, loss_fn


def _trained() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn(model, global_batch(0, 1, per_rank=4)).backward()
    opt.step()
    return model, opt


def _fresh() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(7)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.fixture
def saved(tmp_path) -> str:
    """A Megatron-layout save directory with iteration 10."""
    model, opt = _trained()
    save_checkpoint(str(tmp_path / "run"), 10, model, opt, {"consumed": 40})
    return str(tmp_path / "run")


def _shard(path: str) -> str:
    return os.path.join(path, "__0_0.distcp")


def test_manifest_lists_every_file_with_its_sha256(saved):
    path = iteration_dir(saved, 10)
    manifest = json.load(open(os.path.join(path, MANIFEST_FILE)))
    assert manifest["algorithm"] == "sha256"
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "checkpoint.json", "extra.pt",
                                         "rng/rank_00000.pt"]
    for name, entry in manifest["files"].items():
        assert (entry["size"], entry["sha256"]) == file_digest(os.path.join(path, name)), name


def test_overwritten_bytes_are_found_and_named(saved, tmp_path, capsys):
    path = iteration_dir(saved, 10)
    with open(_shard(path), "r+b") as f:  # 256 bytes in the middle of the shard: tensors, not headers
        f.seek(os.path.getsize(_shard(path)) // 2)
        f.write(b"\xff" * 256)
    for load in (lambda: load_checkpoint(saved, *_fresh()), lambda: load_state(path, *_fresh())):
        with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp does not match its SHA-256"):
            load()
    assert cli(["export", "--checkpoint", saved, "--output", str(tmp_path / "m.safetensors")]) == 2
    assert "__0_0.distcp does not match its SHA-256" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "m.safetensors")


def test_truncated_shard_is_named_with_and_without_manifest(saved):
    path = iteration_dir(saved, 10)
    size = os.path.getsize(_shard(path))
    with open(_shard(path), "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointCorruptError, match=rf"__0_0\.distcp has {size - 100} bytes, manifest.json says"):
        load_checkpoint(saved, *_fresh())
    os.remove(os.path.join(path, MANIFEST_FILE))  # as an older checkpoint: the DCP metadata still tells
    with pytest.warns(UserWarning, match="has no manifest.json"):
        with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp has .* needs at least .*\(truncated\)"):
            load_checkpoint(saved, *_fresh())


@pytest.mark.parametrize("content", [b"", b"\x80garbage" * 10, "é".encode("latin-1") * 50])
def test_garbage_or_empty_metadata_is_named(saved, tmp_path, capsys, content):
    path = iteration_dir(saved, 10)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata"):
        load_checkpoint(saved, *_fresh())
    os.remove(os.path.join(path, MANIFEST_FILE))  # without a manifest the file is still named
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(CheckpointCorruptError, match=r"\.metadata cannot be read \(\w+Error"):
            load_state(path, *_fresh())
        assert cli(["export", "--checkpoint", path, "--output", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert ".metadata cannot be read" in err and "Traceback" not in err, err


@pytest.mark.parametrize("name,content,error", [
    ("extra.pt", b"not a pickle at all", r"extra\.pt cannot be read"),
    ("extra.pt", b"", r"extra\.pt cannot be read"),
    ("checkpoint.json", b"{not json", r"checkpoint\.json cannot be read \(JSONDecodeError"),
    ("checkpoint.json", b"\xff\xfe", r"checkpoint\.json cannot be read \(UnicodeDecodeError"),
    ("rng/rank_00000.pt", b"\x80\x04garbage", r"rank_00000\.pt cannot be read"),
])
def test_garbage_parts_are_named_without_manifest(saved, name, content, error):
    path = iteration_dir(saved, 10)
    os.remove(os.path.join(path, MANIFEST_FILE))
    with open(os.path.join(path, name), "wb") as f:
        f.write(content)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(CheckpointCorruptError, match=error):
            load_checkpoint(saved, *_fresh())


@pytest.mark.parametrize("name", ["extra.pt", "checkpoint.json", "rng/rank_00000.pt", "__0_0.distcp"])
def test_a_missing_part_is_an_error_naming_it(saved, name):
    path = iteration_dir(saved, 10)
    os.remove(os.path.join(path, name))
    with pytest.raises(CheckpointIncompleteError, match=rf"{name.replace('.', '[.]')} is missing"):
        load_checkpoint(saved, *_fresh())
    os.remove(os.path.join(path, MANIFEST_FILE))  # older checkpoints: the same, from the layout itself
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(CheckpointIncompleteError, match=rf"{name.split('/')[-1].replace('.', '[.]')}"):
            load_checkpoint(saved, *_fresh())


def test_checkpoint_without_manifest_loads_with_a_warning(saved):
    os.remove(os.path.join(iteration_dir(saved, 10), MANIFEST_FILE))
    model, opt = _fresh()
    with pytest.warns(UserWarning, match="has no manifest.json .* cannot be checked"):
        loaded = load_checkpoint(saved, model, opt)
    reference, _ = _trained()
    assert loaded.extra == {"consumed": 40}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_tracker_never_moves_back(saved):
    model, opt = _trained()
    save_checkpoint(saved, 20, model, opt)
    before = sorted(os.listdir(saved))
    with pytest.raises(ValueError, match=r"refusing to save iteration 10 .* names iteration 20"):
        save_checkpoint(saved, 10, model, opt)
    assert open(os.path.join(saved, TRACKER_FILE)).read().strip() == "20" and sorted(os.listdir(saved)) == before
    save_checkpoint(saved, 20, model, opt)  # the same iteration again: a replacement
    assert load_checkpoint(saved, *_fresh()).iteration == 20


def test_replacing_an_iteration_keeps_one_at_every_instant(saved, monkeypatch):
    model, opt = _trained()
    path = iteration_dir(saved, 10)
    inode = os.stat(path).st_ino
    save_checkpoint(saved, 10, model, opt, {"consumed": 41})
    assert os.stat(path).st_ino != inode and load_checkpoint(saved, *_fresh()).extra == {"consumed": 41}
    if sys.platform.startswith("linux"):  # the primary path swaps the two directories in one call
        a, b = os.path.join(saved, "x"), os.path.join(saved, "y")
        os.makedirs(os.path.join(a, "from_a"))
        os.makedirs(os.path.join(b, "from_b"))
        assert checkpoint_dirs.exchange(a, b)
        assert os.listdir(a) == ["from_b"] and os.listdir(b) == ["from_a"]

    # Where directories cannot be exchanged: a crash between the two renames leaves no iter_0000010,
    # and loads fall back to the old copy kept beside it.
    monkeypatch.setattr(checkpoint_dirs, "exchange", lambda a, b: False)
    real_rename, calls = os.rename, []

    def crash_on_second(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash between the renames")
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint_dirs, "_rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(saved, 10, model, opt, {"consumed": 42})
    monkeypatch.setattr(checkpoint_dirs, "_rename", real_rename)
    assert not os.path.exists(path)
    with pytest.warns(UserWarning, match="a save replacing it was interrupted"):
        loaded = load_checkpoint(saved, *_fresh())
    assert loaded.iteration == 10 and loaded.extra == {"consumed": 41}
    save_checkpoint(saved, 10, model, opt, {"consumed": 43})  # keeps the old copy: it was the only one
    save_checkpoint(saved, 10, model, opt, {"consumed": 44})  # iter_0000010 exists again: now it goes
    assert sorted(os.listdir(saved)) == ["iter_0000010", TRACKER_FILE, "x", "y"], os.listdir(saved)
    assert load_checkpoint(saved, *_fresh()).extra == {"consumed": 44}


def _dead_pid_scratch(parent: str, name: str) -> str:
    """Scratch of a save whose process is gone: a lock file with an owner, nobody holding it."""
    os.makedirs(os.path.join(parent, f".{name}.tmp-0123456789ab", "sub"))
    with open(os.path.join(parent, f".{name}.tmp-0123456789ab.lock"), "w") as f:
        f.write("somehost 1\n")
    return os.path.join(parent, f".{name}.tmp-0123456789ab")


def test_stale_scratch_is_removed_live_and_legacy_scratch_kept(saved):
    model, opt = _trained()
    stale = _dead_pid_scratch(saved, "iter_0000011")
    legacy = os.path.join(saved, ".iter_0000012.tmp-abcdef012345")  # an older version's: no lock file
    os.makedirs(legacy)
    with open(os.path.join(legacy, "__0_0.distcp"), "wb") as f:
        f.write(b"x" * (1 << 20))
    live = checkpoint_dirs.ScratchDir(os.path.join(saved, "iter_0000013"))  # a save in progress
    try:
        with pytest.warns(UserWarning, match=r"older version: \.iter_0000012\.tmp-abcdef012345 \(1\.0 MiB\)"):
            save_checkpoint(saved, 14, model, opt)
        assert not os.path.exists(stale) and not os.path.exists(stale + ".lock")
        assert os.path.isdir(legacy) and os.path.isdir(live.path) and os.path.exists(live.lock_path)
    finally:
        live.close(remove=True)
    assert not os.path.exists(live.path) and not os.path.exists(live.lock_path)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the scenarios fork a child per kill")
def test_sigkill_during_saves_never_leaves_the_tracker_on_an_incomplete_checkpoint(tmp_path):
    """SIGKILL at each step of a save and at chosen delays; the tracker always names a checkpoint that loads.

    The scenarios run in one subprocess (tests/unit/checkpoint/checkpoint_kill_scenarios.py), which
    forks a child per kill; the next save must leave no scratch behind.
    """
    scenarios = "tests.unit.checkpoint.checkpoint_kill_scenarios"
    done = subprocess.run([sys.executable, "-m", scenarios, str(tmp_path / "run")],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
    for scenario in ("after the DCP write", "after the manifest", "after swapping the directories",
                     "before the tracker write"):
        assert f"{scenario}: tracker at" in done.stdout, done.stdout


def test_save_state_failure_leaves_nothing(tmp_path):
    model, opt = _trained()

    def fail(tmp: str) -> None:
        raise OSError("disk full (simulated)")

    with pytest.raises(OSError, match="disk full"):
        save_state(str(tmp_path / "c"), model, opt, before_commit=fail)
    assert os.listdir(tmp_path) == []


class _Tagged(torch.Tensor):
    """A tensor subclass that torch.save pickles by class, as torchao's float8 weights are."""


def test_a_pickled_tensor_class_not_allowlisted_is_named_not_called_damage(tmp_path):
    import torch.distributed.checkpoint as dcp

    from megatron_fsdp.checkpoint.export import CheckpointClassError, read_full_tensor

    weight = torch.arange(6.0).reshape(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # single process
        dcp.save({"model.w": weight.as_subclass(_Tagged)}, checkpoint_id=str(tmp_path), no_dist=True)
    name = f"{__name__}._Tagged"
    with pytest.raises(CheckpointClassError, match=rf"class {name}, .* import {__name__} first"):
        read_full_tensor(str(tmp_path), "model.w")
    with torch.serialization.safe_globals([_Tagged]):
        got = read_full_tensor(str(tmp_path), "model.w")
    assert type(got) is torch.Tensor and torch.equal(got, weight)
