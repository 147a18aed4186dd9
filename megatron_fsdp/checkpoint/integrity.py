"""Integrity of checkpoint directories: a SHA-256 manifest, checks of parts and sizes, errors naming the file.

``manifest.json`` lists every file of a checkpoint directory with its size and
SHA-256, written last (just before the directory is renamed into place), so any
later change to a file (a flipped bit, an overwritten block, truncation, a file
deleted) is found before anything is loaded. The digests are those of
``sha256sum``, so a checkpoint can also be checked by hand (in its directory)::

    python -c "import json; m = json.load(open('manifest.json'))
    for k, v in m['files'].items(): print(v['sha256'] + '  ' + k)" | sha256sum -c

Everything here works on one process's share of the files; the collective
parts (who hashes what, agreeing on errors) are in ``sharded_io``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import Metadata

MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"
MANIFEST_ALGORITHM = "sha256"
CHUNK_BYTES = 8 << 20  # files are hashed in 8 MiB pieces: memory stays flat whatever the shard size

T = TypeVar("T")


class CheckpointCorruptError(ValueError):
    """A checkpoint file is damaged: its bytes differ from the manifest's, it is truncated or unreadable."""


class CheckpointIncompleteError(FileNotFoundError):
    """A part of a checkpoint (a shard, ``extra.pt``, an RNG file ...) is missing."""


# -- hashing -------------------------------------------------------------------
def file_digest(path: str, *, fsync: bool = False) -> tuple[int, str]:
    """``(size, sha256 hex)`` of ``path``, read in ``CHUNK_BYTES`` pieces.

    ``fsync=True`` also flushes the file to stable storage (the save's files are
    hashed right after being written, so this costs no second pass).
    """
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK_BYTES)
            if not block:
                break
            digest.update(block)
            size += len(block)
        if fsync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


def list_files(directory: str) -> dict[str, int]:
    """``relative path -> size`` of every file under ``directory`` except the manifest (``/`` separated)."""
    out: dict[str, int] = {}
    for root, _, names in os.walk(directory):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, directory).replace(os.sep, "/")
            if rel != MANIFEST_FILE:
                out[rel] = os.path.getsize(full)
    return dict(sorted(out.items()))


def share(sizes: dict[str, int], parts: int, index: int) -> list[str]:
    """The files part ``index`` of ``parts`` handles: largest first, each to the least loaded part."""
    loads = [0] * parts
    mine = []
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        target = min(range(parts), key=lambda i: (loads[i], i))
        loads[target] += max(size, 1)
        if target == index:
            mine.append(name)
    return mine


def hash_files(directory: str, names: list[str], *, fsync: bool = False) -> dict[str, dict[str, Any]]:
    """Manifest entries ``{name: {"size": n, "sha256": hex}}`` of ``names`` under ``directory``."""
    out = {}
    for name in names:
        size, digest = file_digest(os.path.join(directory, name), fsync=fsync)
        out[name] = {"size": size, MANIFEST_ALGORITHM: digest}
    return out


def manifest_text(entries: dict[str, dict[str, Any]]) -> bytes:
    return json.dumps({"algorithm": MANIFEST_ALGORITHM, "files": dict(sorted(entries.items()))}, indent=1).encode()


def read_manifest(directory: str) -> dict[str, dict[str, Any]] | None:
    """The manifest's file entries, or None when the directory has no manifest (older or foreign checkpoints)."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
        files = data["files"]
        if data.get("algorithm") != MANIFEST_ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"expected algorithm {MANIFEST_ALGORITHM!r} and a 'files' table")
        for name, entry in files.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or "sha256" not in entry:
                raise ValueError(f"entry {name!r} lacks an integer 'size' and a 'sha256'")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(
            f"{path} is not a valid checkpoint manifest ({type(exc).__name__}: {exc}); it is written by "
            "save_state as the last file of a checkpoint: the directory was damaged after the save"
        ) from exc
    return files


# A problem: (True if the file is missing, else False; the message naming the file).
Problem = tuple[bool, str]


def verify_files(directory: str, expected: dict[str, dict[str, Any]], names: list[str]) -> list[Problem]:
    """Problems with ``names`` (relative paths) against the manifest's ``expected`` entries; empty if all match."""
    problems: list[Problem] = []
    for name in names:
        path = os.path.join(directory, name)
        want = expected[name]
        if not os.path.isfile(path):
            problems.append((True, f"{path} is missing (listed in {MANIFEST_FILE})"))
            continue
        size = os.path.getsize(path)
        if size != want["size"]:
            problems.append((False, f"{path} has {size} bytes, {MANIFEST_FILE} says {want['size']} "
                                    "(truncated or overwritten)"))
            continue
        _, digest = file_digest(path)
        if digest != want[MANIFEST_ALGORITHM]:
            problems.append((False, f"{path} does not match its SHA-256 in {MANIFEST_FILE} (its bytes changed "
                                    "after the save)"))
    return problems


def describe_problems(directory: str, problems: list[Problem]) -> Exception:
    """One error for a list of problems: incomplete if files are only missing, else corrupt (first five listed)."""
    messages = [m for _, m in problems]
    listed = "; ".join(messages[:5]) + (f"; ... and {len(messages) - 5} more" if len(messages) > 5 else "")
    advice = "Restore the checkpoint from a copy, or load an earlier iteration"
    if all(missing for missing, _ in problems):
        return CheckpointIncompleteError(f"checkpoint {directory} is incomplete: {listed}. {advice}")
    return CheckpointCorruptError(f"checkpoint {directory} is damaged: {listed}. {advice}")


# -- DCP structure ---------------------------------------------------------------
def check_storage_files(directory: str, metadata: Metadata) -> None:
    """Every data file the DCP metadata refers to exists and is long enough (truncation, deletion).

    Cheap (a ``stat`` per file), so it runs also for checkpoints without a manifest.
    """
    ends: dict[str, int] = {}
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return  # another storage layout: nothing to check against
    for info in storage.values():
        rel, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if isinstance(rel, str) and isinstance(offset, int) and isinstance(length, int):
            ends[rel] = max(ends.get(rel, 0), offset + length)
    problems: list[Problem] = []
    for rel, end in sorted(ends.items()):
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            problems.append((True, f"{path} is missing (the DCP {METADATA_FILE} refers to it)"))
        elif os.path.getsize(path) < end:
            problems.append((False, f"{path} has {os.path.getsize(path)} bytes, the DCP {METADATA_FILE} needs at "
                                    f"least {end} (truncated)"))
    if problems:
        raise describe_problems(directory, problems)


def read_part(path: str, what: str, reader: Callable[[str], T]) -> T:
    """``reader(path)``, turning a missing file or any decoding error into an error naming ``path``.

    ``what`` says what the file holds (for the message).
    """
    if not os.path.isfile(path):
        raise CheckpointIncompleteError(
            f"checkpoint part {path} is missing: it holds {what}. The checkpoint is incomplete; restore it from a "
            "copy or load an earlier iteration"
        )
    try:
        return reader(path)
    except Exception as exc:  # unpickling, zip, JSON and Unicode errors of torch/numpy/pickle/json
        raise CheckpointCorruptError(
            f"checkpoint part {path} cannot be read ({type(exc).__name__}: {exc}); it should hold {what}. The file "
            "is damaged or was replaced; restore it from a copy or load an earlier iteration"
        ) from exc
