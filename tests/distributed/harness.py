"""Run many named checks inside one group of processes (gloo on CPU, or NCCL with one GPU per rank).

Launching processes is the slow part of a distributed test, so the checks of
every suite of a directory (``pytest_suite``'s group) run in one spawned group per
world size; pytest then reports every check separately from the collected results.

- ``@check(SUITE, world_sizes, params)`` registers a function (one check per
  combination of ``params``); ``pytest_suite(module)`` is the test file's shim.
- ``MEGATRON_FSDP_TEST_BACKEND`` picks the backend: ``gloo`` (default, CPU) or ``nccl`` (one
  process per GPU; a world size larger than the visible GPUs is skipped). Checks create
  tensors and meshes on ``device()`` / ``device_type()``, never on a hard-coded ``"cpu"``.
- Every rank writes ``{name: None or traceback}`` after each check; a check fails
  if it failed on any rank, and a rank that died fails every check it did not
  report (``SuiteRun.failures``). Nothing is retried.

tests/README.md says how to add a check.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import gc
import inspect
import itertools
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CHECKS: dict[str, list[tuple[str, Callable[[], None]]]] = {}  # "<suite>@<world size>" -> [(name, check)]
# A check still running after this long prints every thread's stack (to the
# test's captured stderr) before gloo's 120 s timeout turns a hang into a bare
# "Application timeout" with no trace of where each rank was.
WATCHDOG_S = 90
# A fixed mmap threshold makes glibc return freed large blocks to the OS at once, so
# peak-RSS checks measure tensors, not allocator caching (set for the ranks by run_suite).
MMAP_THRESHOLD = 1 << 16
# Types a parameter value may have: each is written into the check's name as str(value).
PARAM_TYPES = (str, int, float, bool)
IMPORT_ERROR = "<import>"  # a rank's result key for a suite whose module it could not import (fails each check)
BACKEND_ENV = "MEGATRON_FSDP_TEST_BACKEND"  # "gloo" (default) or "nccl"
BACKENDS = {"gloo": "cpu", "nccl": "cuda"}  # backend -> the device type its ranks compute on
# Where rank 0 appends "<seconds> <world size> <suite>: <check>" per check (unset: nowhere). A group's time
# shows in pytest's --durations as one setup; this says which checks it went to.
TIMES_ENV = "MEGATRON_FSDP_TEST_TIMES"
# "0" runs a group's launches (one per world size) one after the other; by default, on gloo, they run at
# once (see ``_launch``).
OVERLAP_ENV = "MEGATRON_FSDP_TEST_OVERLAP"
Params = Mapping[str, Sequence[object]]  # parameter name -> the values a check runs with


def variants(fn: Callable[..., None], params: Params | None) -> list[tuple[str, Callable[[], None]]]:
    """``fn`` once per combination of ``params`` values, named ``fn[key=value,...]`` (just ``fn`` without params).

    Combinations are the cartesian product in the order given; each calls ``fn(**combination)``.
    """
    if not params:
        return [(fn.__name__, fn)]
    for key, values in params.items():
        if isinstance(values, str | bytes) or not values:
            raise ValueError(f"check {fn.__name__}: params[{key!r}] must be a non-empty list of values, got {values!r}")
        bad = [v for v in values if not isinstance(v, PARAM_TYPES)]
        if bad:
            raise TypeError(f"check {fn.__name__}: params[{key!r}] values must be str, int, float or bool "
                            f"(they name the check), got {bad!r}")
    try:
        inspect.signature(fn).bind(**dict.fromkeys(params))
    except TypeError as exc:
        raise TypeError(f"check {fn.__name__}: params {sorted(params)} do not fit its arguments: {exc}") from None
    found = []
    for combination in itertools.product(*params.values()):
        kwargs = dict(zip(params, combination))
        label = ",".join(f"{key}={value}" for key, value in kwargs.items())
        found.append((f"{fn.__name__}[{label}]", functools.partial(fn, **kwargs)))
    return found


def check(suite: str, world_sizes: tuple[int, ...] = (2, 4), params: Params | None = None):
    """Register ``fn`` as a check of ``suite`` run at each of ``world_sizes``.

    ``params={"strategy": ["optim", "no_shard"]}`` registers one check per value (per combination, for
    several keys), named ``fn[strategy=optim]`` and called as ``fn(strategy="optim")``; every variant runs
    in the suite's one process group per world size, so parameters cost no process launches.
    """

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        found = variants(fn, params)
        for n in world_sizes:
            registered = CHECKS.setdefault(f"{suite}@{n}", [])
            for name, variant in found:
                if name in (known for known, _ in registered):
                    # results are keyed by name: a second check of the same name would hide the first's outcome
                    raise ValueError(f"suite {suite!r} already has a check named {name!r} at world size {n}")
                registered.append((name, variant))
        return fn

    return register


def backend() -> str:
    """The process-group backend the suites run on: ``$MEGATRON_FSDP_TEST_BACKEND``, default ``gloo``."""
    name = os.environ.get(BACKEND_ENV, "gloo").strip().lower() or "gloo"
    if name not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={name!r} is not a test backend; use one of {sorted(BACKENDS)}")
    return name


def device_type() -> str:
    """``"cpu"`` (gloo) or ``"cuda"`` (nccl): what ``init_device_mesh`` and ``to_empty`` take in checks."""
    return BACKENDS[backend()]


def device() -> torch.device:
    """This rank's device: the CPU, or (nccl) the GPU of its local rank (set current by the harness)."""
    if device_type() == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))


def skip_reason(world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot run on this machine's backend (None: they can)."""
    if backend() != "nccl":
        return None
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        return "MEGATRON_FSDP_TEST_BACKEND=nccl needs CUDA and NCCL"
    visible = torch.cuda.device_count()
    if visible < max(world_size, 2):
        return f"{world_size} ranks on nccl need {max(world_size, 2)} GPUs, {visible} visible"
    return None


def names(suite: str, world_size: int) -> list[str]:
    """The names of ``suite``'s checks at ``world_size``, in the order they run."""
    return [name for name, _ in CHECKS.get(f"{suite}@{world_size}", [])]


@contextlib.contextmanager
def shared_tmpdir(prefix: str = "mfsdp_") -> Iterator[str]:
    """A temporary directory rank 0 creates and every rank gets the path of; removed on exit."""
    holder = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    try:
        yield holder[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(holder[0], ignore_errors=True)


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port nothing listens on, never one this process handed out before: launches that run at once
    (``_launch``) each get their own, though their ranks bind it only seconds after it was chosen."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def _write_results(out_dir: str, rank: int, results: dict[str, dict[str, str | None]]) -> None:
    tmp = os.path.join(out_dir, f"rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))


def _record_time(rank: int, world_size: int, what: str, seconds: float) -> None:
    """Append rank 0's time of a passed check to ``$MEGATRON_FSDP_TEST_TIMES`` (where the suite's time goes)."""
    path = os.environ.get(TIMES_ENV)
    if path and rank == 0:
        with open(path, "a") as f:
            f.write(f"{seconds:8.2f} {world_size} {what}\n")


def _group_counts() -> list[int]:
    """Every rank's count of process groups created so far, in rank order (a collective: a barrier too)."""
    mine = torch.tensor([dist.distributed_c10d._world.group_count], dtype=torch.int64, device=device())
    everyone = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device())
    dist.all_gather_into_tensor(everyone, mine)
    return everyone.tolist()


def _worker(rank: int, world_size: int, port: int, suites: list[tuple[str, str]], out_dir: str) -> None:
    """Run each ``(module, suite)`` of ``suites`` in turn on this rank; results go to ``rank<r>.json``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)  # a native crash (SIGSEGV/SIGABRT) prints where each thread was
    if device_type() == "cuda":
        # One GPU per rank; tensors the checks create without a device land on it, as the
        # models' parameters must for NCCL (the checks themselves stay device-agnostic).
        torch.cuda.set_device(device())
        torch.set_default_device(device())
    dist.init_process_group(backend(), rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    # The objects of the imports (torch's, the suites') live as long as the rank: frozen, Python's automatic
    # full collections skip them instead of traversing some 300k objects each time (about a sixth of a rank's
    # time in a run of tests/distributed went to the collector before; checks' own objects are still collected).
    gc.freeze()
    results: dict[str, dict[str, str | None]] = {}  # suite -> check name -> None or the error
    for s, (module, suite) in enumerate(suites):
        results[suite] = {}
        try:
            __import__(module)  # registers the suite's checks in this process
            gc.freeze()  # see _worker's first gc.freeze()
        except Exception:  # the suite's own failure (reported on each of its checks), not the group's
            results[suite] = {IMPORT_ERROR: f"importing {module} failed:\n{traceback.format_exc()}"}
            _write_results(out_dir, rank, results)
            continue
        checks = CHECKS[f"{suite}@{world_size}"]
        for i, (name, fn) in enumerate(checks):
            try:
                print(f"[rank {rank}] {suite}: {name}", file=sys.stderr, flush=True)  # shown on failure
                torch.manual_seed(1234)
                faulthandler.dump_traceback_later(WATCHDOG_S)
                started = time.perf_counter()
                fn()
                results[suite][name] = None
                _record_time(rank, world_size, f"{suite}: {name}", time.perf_counter() - started)
            except Exception:  # reported per check by pytest
                results[suite][name] = traceback.format_exc()
            except BaseException:  # SystemExit, or KeyboardInterrupt (SIGINT): spawn's wrapper exits 0 on
                # it, so without this record the check would read "no results written" with no cause
                results[suite][name] = f"the rank was stopped inside this check:\n{traceback.format_exc()}"
                _write_results(out_dir, rank, results)
                raise
            finally:
                faulthandler.cancel_dump_traceback_later()
            _write_results(out_dir, rank, results)  # kept even if this rank dies below
            try:
                counts = _group_counts()  # also the barrier between checks
            except Exception:
                counts = None
            if counts is None or len(set(counts)) > 1:
                # A check that failed on some ranks only leaves the others in a collective
                # that times out and breaks the group; one that made process groups on some ranks
                # only leaves the next group any check creates hanging (torch numbers groups per
                # rank). Report the checks left unrun (this suite's and the later suites') and
                # stop, so pytest shows the failing check's own error, not a lost rank.
                if counts is not None and results[suite][name] is None:
                    results[suite][name] = (
                        f"this check left the ranks with different numbers of process groups ({counts}): it made a "
                        "mesh or group on some ranks only; every rank must create each one (members or not)")
                broke = f"not run: the process group broke after {suite}: {name!r} (a rank failed or hung there)"
                results[suite].update(dict.fromkeys((later for later, _ in checks[i + 1:]), broke))
                for later_module, later_suite in suites[s + 1:]:
                    with contextlib.suppress(Exception):
                        __import__(later_module)
                    results[later_suite] = dict.fromkeys(
                        (later for later, _ in CHECKS.get(f"{later_suite}@{world_size}", [])), broke)
                _write_results(out_dir, rank, results)
                # Leave at once, skipping interpreter shutdown: a gloo group broken by a timeout or a
                # lost peer cannot be destroyed (destroy_process_group and the group's destructors wait
                # on, or abort over, the dead connections), and this rank's results are on disk. Status
                # 0 because the failures are reported per check above, not as a lost rank.
                os._exit(0)
        gc.collect()  # the suite's models and buffers, before the next suite measures memory
    # Reference cycles inside torch keep finished gloo work alive; freed at
    # interpreter exit they abort the process ("terminate called without an
    # active exception"). Collect them while the process group still exists.
    gc.collect()
    dist.destroy_process_group()


@dataclass
class SuiteRun:
    """One run of a suite: what each rank reported, and how a rank that failed to exit cleanly ended."""

    per_rank: list[dict[str, str | None]]  # check name -> None (passed) or the error
    death: str | None = None  # e.g. "process 0 terminated with signal SIGABRT"; None if every rank exited 0
    signal: str | None = None  # the signal that killed that rank ("SIGABRT"), if one did

    def failures(self, expected: list[str]) -> dict[str, list[str]]:
        """Errors per check name (empty list: passed on every rank).

        A rank that died fails every check it did not report, with its exit reason. A
        rank that died after reporting them all (a crash at interpreter exit) fails
        every check as well: a crash is a lost job whenever it happens, never retried.
        A suite a rank could not import fails each of its checks with the import's error.
        """
        failures: dict[str, list[str]] = {name: [] for name in expected}
        for r, results in enumerate(self.per_rank):
            for name in expected:
                error = results.get(name, results.get(IMPORT_ERROR)
                                    or f"not reported: the rank died ({self.death or 'no results written'})")
                if error:
                    failures[name].append(f"rank {r}:\n{error}")
        if self.death is not None and all(set(expected) <= set(results) for results in self.per_rank):
            for name in expected:
                failures[name].append(f"a rank died after reporting every check: {self.death}")
        return failures


def run_suites_once(suites: Sequence[tuple[str, str]], world_size: int) -> dict[str, SuiteRun]:
    """Spawn ``world_size`` fresh ranks running each ``(module, suite)`` in turn; what each suite's ranks reported.

    One launch for all of them: the launch (an interpreter, torch and a process group per rank) costs
    seconds, often more than a small suite's checks. A rank's death is every suite's ``death``.
    """
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    suites = list(suites)
    if len({suite for _, suite in suites}) != len(suites):
        raise ValueError(f"a suite is named twice in one group: {suites}")
    death, signal_name = None, None
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(
                _worker, args=(world_size, free_port(), suites, out_dir), nprocs=world_size,
                start_method="spawn", join=True,
            )
        except mp.ProcessExitedException as exc:  # a signal or a non-zero exit code
            death, signal_name = str(exc), exc.signal_name
        except mp.ProcessRaisedException as exc:  # an exception outside any check (set-up)
            death = str(exc).strip()
        per_rank = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    per_rank.append(json.load(f))
            else:
                per_rank.append({})
    return {suite: SuiteRun([rank.get(suite, {}) for rank in per_rank], death, signal_name) for _, suite in suites}


def run_suite_once(module: str, suite: str, world_size: int) -> SuiteRun:
    """Spawn ``world_size`` fresh ranks running ``suite`` once; collect what they reported."""
    return run_suites_once([(module, suite)], world_size)[suite]


def run_suites(suites: Sequence[tuple[str, str]], world_size: int) -> dict[str, dict[str, list[str]]]:
    """Spawn ``world_size`` ranks running each ``(module, suite)``; failures per check name, per suite."""
    for module, _ in suites:
        __import__(module)  # the checks' names, to report any a rank never finished
    runs = run_suites_once(suites, world_size)
    return {suite: run.failures(names(suite, world_size)) for suite, run in runs.items()}


def run_suite(module: str, suite: str, world_size: int) -> dict[str, list[str]]:
    """Spawn ``world_size`` ranks running ``suite``; return failures per check name (see ``SuiteRun``)."""
    return run_suites([(module, suite)], world_size)[suite]


# Packages whose suites keep processes of their own: megatron-core's (it sets process-wide globals and
# makes hundreds of process groups) and the memory measurements (a process's resident set is their subject).
_OWN_GROUP_PACKAGES = ("tests.distributed.mcore", "tests.distributed.memory")


def default_group(module: str) -> str:
    """The launch group of a checks module: all of tests/distributed shares one (one launch per world size
    instead of one per directory), but for ``_OWN_GROUP_PACKAGES``; other trees, their package.

    A single group once hung (2026-11-28: every rank in a gloo rendezvous of a new group after other
    directories' suites had made groups on some ranks only); the cause, torch naming member-made groups
    by each rank's count of groups, is fixed in megatron_fsdp/comm/local_groups.py, and the harness
    checks after every check that all ranks made the same number of groups.
    """
    package = module.rpartition(".")[0]
    if package.startswith("tests.distributed") and package not in _OWN_GROUP_PACKAGES:
        return "tests.distributed"
    return package


# (group, world size) -> suite -> failures per check name: the runs of this pytest session
_GROUP_RESULTS: dict[tuple[str, int], dict[str, dict[str, list[str]]]] = {}
# (group, world size) -> its launch, running or done
_LAUNCHES: dict[tuple[str, int], Future] = {}
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="harness-launch")  # threads start at the first launch


def _group_items(session, group: str) -> Iterator[tuple[tuple[str, str], object]]:
    """``((module, suite), world size)`` of each test of ``group`` selected in this session, in test order."""
    for item in getattr(session, "items", []):
        member = getattr(getattr(item, "function", None), "_harness_suite", None)
        callspec = getattr(item, "callspec", None)
        if member is not None and callspec is not None and member[2] == group:
            yield member[:2], callspec.params.get("results")


def _selected_suites(session, group: str, world_size: int) -> list[tuple[str, str]]:
    """The ``(module, suite)`` of ``group`` with a test selected at ``world_size`` in this session, in test order."""
    found: list[tuple[str, str]] = []
    for member, size in _group_items(session, group):
        if size == world_size and member not in found:
            found.append(member)
    return found


def _selected_world_sizes(session, group: str) -> list[int]:
    """The world sizes at which ``group`` has a test selected in this session (and this machine can run)."""
    found = {size for _, size in _group_items(session, group)}
    return sorted(n for n in found if isinstance(n, int) and skip_reason(n) is None)


def _overlap() -> bool:
    """Run a group's world sizes at once: on gloo only (with NCCL they would share the GPUs), unless turned off."""
    return backend() == "gloo" and os.environ.get(OVERLAP_ENV, "1") != "0"


def _launch(session, group: str, world_size: int) -> Future:
    """The launch of ``group``'s selected suites at ``world_size`` (started here if it was not yet).

    On gloo the first launch of a group also starts the group's other world sizes, in a second thread:
    ranks of one group spend about a sixth of their time waiting on each other (collectives, the barrier
    between checks), which the other group's ranks then use; the checks are the same, each world size
    still in its own processes.
    """
    others = [n for n in _selected_world_sizes(session, group) if n != world_size] if _overlap() else []
    for n in [world_size, *others]:
        if (group, n) not in _LAUNCHES:
            members = [m for m in _selected_suites(session, group, n) if names(m[1], n)]
            future: Future = Future()
            if members:
                future = _POOL.submit(run_suites, members, n)
            else:
                future.set_result({})
            _LAUNCHES[(group, n)] = future
    return _LAUNCHES[(group, world_size)]


def pytest_suite(checks_module, world_sizes: tuple[int, ...] = (2, 4), group: str | None = None):
    """A module-scoped fixture and a parametrized test that run ``checks_module``'s suite.

    Use as ``results, test_<name> = pytest_suite(<checks module>)`` in a test file. Suites of one
    ``group`` share their launches: the first of them to run at a world size runs, in one spawned group,
    every suite of the group that has a test selected at that world size in this pytest session, so
    a directory costs one launch per world size and a single file (or ``-k``) still runs only
    what it selects. The default group is ``default_group(module)`` (all of tests/distributed but
    megatron-core's and the memory suites); a suite that must not share its processes names a group of its own.
    """
    import pytest  # here, not at the top: the spawned ranks import this module and never need pytest

    suite = checks_module.SUITE
    module = checks_module.__name__
    group = group or default_group(module)

    @pytest.fixture(scope="module", params=list(world_sizes))
    def results(request):
        world_size = request.param
        reason = skip_reason(world_size)
        if reason is not None:
            pytest.skip(reason)
        if not names(suite, world_size):
            return world_size, {}  # no check at this world size: its tests skip, and nothing is launched
        done = _GROUP_RESULTS.setdefault((group, world_size), {})
        if suite not in done:
            done.update(_launch(request.session, group, world_size).result())
        if suite not in done:  # not found among the session's selected tests (run on its own)
            done.update(run_suites([(module, suite)], world_size))
        return world_size, done[suite]

    @pytest.mark.parametrize("name", sorted({x for n in world_sizes for x in names(suite, n)}))
    def test(results, name):
        world_size, failures = results
        if name not in failures:
            pytest.skip(f"{name} does not run at world size {world_size}")
        assert not failures[name], "\n".join(failures[name])

    test._harness_suite = (module, suite, group)  # found by _selected_suites
    return results, test


def spawn_and_collect(worker: Callable[..., None], out_dir: str, nprocs: int = 2) -> list[dict]:
    """Run ``worker(rank, port, out_dir)`` on ``nprocs`` spawned ranks; return each rank's ``rank<r>.json``.

    For tests that drive whole programs (the front-end) rank by rank and report per case.
    """
    mp.start_processes(worker, args=(free_port(), out_dir), nprocs=nprocs, start_method="spawn", join=True)
    per_rank = []
    for rank in range(nprocs):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            per_rank.append(json.load(f))
    return per_rank


def error_on_every_rank(runs: list[dict], name: str) -> str:
    """Rank 0's error of case ``name``, after checking that every rank failed (none left training alone)."""
    errors = [rank[name].get("error") for rank in runs]
    assert None not in errors, f"{name}: expected an error on every rank, got {errors}\n{runs[0][name].get('log', '')}"
    return errors[0]

