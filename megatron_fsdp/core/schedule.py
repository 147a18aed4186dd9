"""The order of every collective under one root: the same on every rank, whatever ran.

Which units run can depend on the data (experts that receive no token, optional
branches, early exit), and a collective pairs with whatever the other ranks
issue next on the same process group. Ranks that ran different units must still
issue the same collectives in the same order, or one unit's gradients are summed
with another's (silently, when the sizes match). Three mechanisms keep them in
step (docs/design.md, "Data-dependent execution"):

- **Reductions** run on a process group of their own, one per parameter group and
  backward, in an order every rank knows: the reverse of the unit order agreed at
  the end of the forward. A group's turn comes when its gradients are complete; a
  unit that did not run here contributes zeros (or what earlier micro-batches
  accumulated). A group no rank ran with grad is not reduced: its gradients stay
  ``None``, as DDP's do.
- **ZeRO-3 all-gathers** follow an agreed sequence: rank 0's gathers in the last
  phase of the same kind (forward or backward). A rank that needs a unit further
  along first issues the entries before it (into scratch, dropped), so every rank
  issues every entry, in order. A gather off the sequence (a unit needed again, or
  in an order rank 0 did not take) is agreed in a control round: the rank issues
  the rest of the sequence, then all ranks gather the requested units together.
  ZeRO-1/2 weights are gathered for every unit at the root's forward, in unit order.
- **Control rounds** on a third group (one small MAX all-reduce) close each phase
  once every rank is done. The closing round carries which groups ran with grad
  (forward) or received gradients (backward), and rank 0's orders for next time.

The first step runs before any agreement (unit order = module order); it is as
exact as the others, only slower where the forward order differs from module order.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_fsdp.comm.collectives import Pending, all_reduce_max
from megatron_fsdp.comm.local_groups import new_local_group
from megatron_fsdp.core.group_grads import PendingReduce
from megatron_fsdp.core.param_group import ParamGroup

if TYPE_CHECKING:  # the unit owns the schedule (through its RootState): annotations only
    from megatron_fsdp.core.unit import FSDPUnit


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


_GROUP_COPIES: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}


def group_copy(purpose: str, group: dist.ProcessGroup, ranks: list[int] | None = None) -> dist.ProcessGroup:
    """A process group over ``ranks`` (default: ``group``'s), made once per purpose and rank set.

    Made by the member ranks only (``comm/local_groups.py``: whatever groups the job made
    on some ranks only before), in the order ``fully_shard`` runs, which is the same on
    every rank. A copy that died with an earlier default group (``destroy_process_group``
    then a new ``init_process_group`` in the same process) is made again.
    """
    ranks = sorted(dist.get_process_group_ranks(group) if ranks is None else ranks)
    key = (purpose, tuple(ranks))
    if key in _GROUP_COPIES and not _registered(_GROUP_COPIES[key]):
        del _GROUP_COPIES[key]
    if key not in _GROUP_COPIES:
        backend = str(dist.get_backend(group))
        _GROUP_COPIES[key] = new_local_group(ranks, backend, purpose)
    return _GROUP_COPIES[key]


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` belongs to the current default group's world (it is unknown after a destroy)."""
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


def is_zero3(unit: FSDPUnit) -> bool:
    """The unit gathers its weights at each use (not once per step)."""
    return unit.plan.params and any(g.gathers for g in unit.groups)


def gathers_once_per_step(unit: FSDPUnit) -> bool:
    """ZeRO-1/2: weights gathered (refreshed) once per step and kept."""
    return not unit.plan.params and any(g.gathers for g in unit.groups)


def _participate(unit: FSDPUnit) -> list[Pending]:
    """Issue ``unit``'s all-gathers into scratch: the data is not needed here, the pairing is."""
    return [group.participate() for group in unit.groups if group.gathers]


@dataclass
class RoundResult:
    active: bool
    requests: list[int]
    flags: list[bool]  # per parameter group: ran with grad (forward) / received gradients (backward)
    extra: list[bool]  # per parameter group: needs a reduction after the ordered ones (backward)
    order: list[int]  # per unit: rank 0's first-use position + 1 (0: not used)
    sequence: list[int]  # rank 0's gathers (unit indices) this phase
    kept: list[bool]  # per unit: every rank keeps its gathered weights past this backward
    used: list[bool]  # per parameter of every group in order: some rank had a gradient for it


class GatherCursor:
    """One phase's agreed all-gather sequence and how far this rank has issued and consumed it.

    ``held``: units every rank holds gathered as the phase starts (``FSDPUnit.weights_held``,
    the same set everywhere): the first entry of each is dropped from the sequence, and
    their first use is still recorded, so rank 0's sequence for next time names them.
    """

    def __init__(self, sequence: list[int], held: set[int] | None = None) -> None:
        self.held = set(held or ())
        dropped: set[int] = set()
        self.sequence = []
        for index in sequence:
            if index in self.held and index not in dropped:
                dropped.add(index)
                continue
            self.sequence.append(index)
        self.next = 0  # entries before it are consumed or passed
        self.issued = 0  # entries before it have their all-gather issued (prefetch runs ahead)
        self.own: set[int] = set()  # issued entries that gather into their unit's own buffer
        self.flushed = False
        self.recorded: list[int] = []  # this rank's gathers, for the next agreement
        self.scratch: list[Pending] = []

    def find(self, unit_index: int) -> int | None:
        for i in range(self.next, len(self.sequence)):
            if self.sequence[i] == unit_index:
                return i
        return None


class CollectiveSchedule:
    """Orders the collectives of every unit under one root (see the module docstring)."""

    def __init__(self, units: list[FSDPUnit], track: Callable[[PendingReduce], None]) -> None:
        self.units = units  # module order, the root first
        self.index = {id(u): i for i, u in enumerate(units)}
        self.groups: list[ParamGroup] = [g for u in units for g in u.groups]
        self.group_index = {id(g): i for i, g in enumerate(self.groups)}
        self.unit_of = {id(g): u for u in units for g in u.groups}
        self._track = track
        self.parent = _enclosing_units(units)  # per unit: the nearest unit whose modules contain it (None: top)
        self.comm = units[0].comm  # the root's (control rounds are counted as its "control" bytes)
        anchor = next((g for g in self.groups), None)
        self.control: dist.ProcessGroup | None = None  # none without parameters: nothing to agree on
        self._own_rounds: list[tuple[dist.ProcessGroup, list[int]]] = []
        self.device = torch.device("cpu")
        self.leader = True
        if anchor is not None:
            dp = anchor.dp
            ranks = dp.mesh.mesh.flatten().tolist()
            self.control = group_copy("control", dp.shard_group, ranks)
            self.device = anchor.device
            self.leader = dist.get_rank(self.control) == 0
            for group in self.groups:
                group.reduce_process_group = group_copy("reduce", group.process_group)
            # Groups over fewer ranks than the control round's (experts: EDP): which ranks had
            # gradients is agreed among their own ranks too, not with ranks holding other experts.
            self._own_rounds = _own_round_groups(self.groups, ranks)
        self.unit_order: list[int] = list(range(len(units)))  # agreed: first-use order of the last forward
        self.sequences: dict[Phase, list[int] | None] = {Phase.FORWARD: None, Phase.BACKWARD: None}
        self.cursor: GatherCursor | None = None
        self.phase: Phase | None = None
        self._first_use: dict[int, None] = {}  # units in first-use order (a dict: O(1) membership)
        self._eligible: list[bool] = [False] * len(self.groups)
        self._reduce_order: list[ParamGroup] = []
        self._reduce_next = 0
        self._issued: set[int] = set()  # groups reduced in this backward (by index)
        self.control_rounds = 0  # since construction, for tests and accounting
        self._names: dict[int, str] | None = None  # module -> name under the root, for messages
        # What this rank issued, compared across ranks by every closing round: the
        # all-gathers of this phase, the reductions of the last backward.
        self._gather_log: list[int] = []
        self._reduce_log: list[int] = []
        self._last_reduce_digest = 0

    # -- phases -------------------------------------------------------------
    def begin_forward(self) -> None:
        self.phase = Phase.FORWARD
        self._gather_log = []
        self._first_use = {}
        self.cursor = GatherCursor(self._default_sequence(Phase.FORWARD), self._take_held())
        # HSDP with outer "optim": rebuild stale compute shards (a blocking all-gather across
        # dp_outer) here, in unit order, where every rank is, and not at a unit's first gather,
        # which a rank that skipped units reaches at another point than its peers.
        for unit in self.units:
            for group in unit.groups:
                if group.outer is not None:
                    group.start_compute_refresh()
        for unit in self.units:  # ZeRO-1/2: every unit's weights, once per step, in unit order
            if gathers_once_per_step(unit):
                for group in unit.groups:
                    group.start_unshard()

    def _take_held(self) -> set[int]:
        """The units whose weights every rank holds as a phase starts; their flags are consumed."""
        held = set()
        for i, unit in enumerate(self.units):
            if unit.weights_held and is_zero3(unit):
                held.add(i)
            unit.weights_held = False
        return held

    def record_use(self, unit: FSDPUnit) -> None:
        index = self.index[id(unit)]
        if self.phase is Phase.FORWARD:
            self._first_use.setdefault(index)

    def end_forward(self, ran_with_grad: list[bool]) -> None:
        """Close the forward: agree who ran what, and the orders for the backward and next forward."""
        flags = [False] * len(self.groups)
        for unit, ran in zip(self.units, ran_with_grad):
            for group in unit.groups:
                if group.requires_grad and (ran or group.holds_grads):
                    flags[self.group_index[id(group)]] = True
        result = self._close(flags, [False] * len(self.groups))
        for unit in self.units:  # ZeRO-1/2 gathers nobody consumed: nothing outlives the forward
            if gathers_once_per_step(unit):
                for group in unit.groups:
                    group.finish_unshard()
        self._eligible = result.flags
        self._agree_unit_order(result.order)
        self.sequences[Phase.FORWARD] = self._complete(result.sequence, Phase.FORWARD)
        self.phase = None
        self.cursor = None

    def begin_backward(self) -> None:
        self.phase = Phase.BACKWARD
        self.cursor = GatherCursor(self._default_sequence(Phase.BACKWARD), self._take_held())
        self._issued = set()
        self._gather_log = []
        self._reduce_log = []
        self._reduce_order = [
            g for i in reversed(self.unit_order) for g in self.units[i].groups
            if g.requires_grad and self._eligible[self.group_index[id(g)]] and self.units[i].reduces_now
        ]
        self._reduce_next = 0
        self.advance_reductions()

    def end_backward(self) -> tuple[list[bool], list[bool], list[set[int] | None]]:
        """Close the backward: issue the reductions left, in the agreed order (not waited for).

        Returns, per parameter group, whether any rank had gradients for it: a
        reduction of zeros only (``PendingReduce.defer_install``) installs nothing
        where no rank had any, so those gradients stay ``None``. And per unit,
        whether every rank keeps its gathered weights for the next forward
        (``set_reshard_after_backward(False)``): kept only where all ranks can, so
        that the next forward's gathers skip it everywhere alike.
        """
        received = [g.received_grads or g.holds_grads for g in self.groups]
        extra = [False] * len(self.groups)
        ordered = {id(g) for g in self._reduce_order}
        for i, group in enumerate(self.groups):
            unit = self.unit_of[id(group)]
            if not group.requires_grad or not unit.reduces_now or not group.holds_grads:
                continue
            # grads arriving after this group's turn, or for a group outside the agreed order
            extra[i] = id(group) not in ordered or i in self._issued
        used = [i in g.used_since_sync for g in self.groups for i in range(len(g.sharded_params))]
        result = self._close(received, extra, keep=[u.keeps_weights_after_backward() for u in self.units],
                             used=used)
        self.sequences[Phase.BACKWARD] = self._complete(result.sequence, Phase.BACKWARD)
        # The rest of the agreed order (zeros where nothing arrived), then the extras.
        for group in self._reduce_order[self._reduce_next:]:
            self._reduce(group)
        self._reduce_next = len(self._reduce_order)
        for i, group in enumerate(self.groups):
            if result.extra[i]:
                self._reduce(group)
        self._last_reduce_digest = _digest(self._reduce_log)
        self.phase = None
        self.cursor = None
        return self._among_own_ranks(received, result.flags), result.kept, self._used_per_group(result.used)

    def _used_per_group(self, used: list[bool]) -> list[set[int] | None]:
        """Per group, the parameters some rank had a gradient for; None for groups over fewer
        ranks than the control round (expert units): their bits are a MAX over ranks outside
        their reduction group, so nothing is dropped there (zeros are kept, as before)."""
        own = {i for _, members in self._own_rounds for i in members}
        out: list[set[int] | None] = []
        offset = 0
        for gi, group in enumerate(self.groups):
            n = len(group.sharded_params)
            out.append(None if gi in own else {i for i in range(n) if used[offset + i]})
            offset += n
        return out

    # -- weights ------------------------------------------------------------
    def need_weights(self, unit: FSDPUnit) -> None:
        """``unit`` is about to compute: gather its weights in agreed order and wait for them."""
        with self.waiting_for(f"the all-gather of {self.describe(unit)}'s weights"):
            self._need_weights(unit)

    def describe(self, unit: FSDPUnit) -> str:
        """``'blocks.0' (Block)``: a unit's name under the root, for messages."""
        if self._names is None:
            root = self.units[0].module
            self._names = {id(m): name for name, m in root.named_modules()}
        module = unit.module
        cls = type(module)
        return f"'{self._names.get(id(module), '?')}' ({cls.__bases__[-1].__name__})"

    @contextlib.contextmanager
    def waiting_for(self, what: str) -> Iterator[None]:
        """Name the collective a failed or timed-out wait was for, and the likely cause."""
        try:
            yield
        except RuntimeError as exc:  # gloo raises RuntimeError, NCCL DistBackendError (a subclass)
            phase = self.phase.value if self.phase is not None else "step"
            raise type(exc)(
                f"{what} failed in the {phase} ({exc}). If it timed out, another data-parallel rank "
                "did not reach the same point: every rank must run the sharded model's forward and "
                "backward the same number of times (e.g. the same number of batches per rank)"
            ) from exc

    def _need_weights(self, unit: FSDPUnit) -> None:
        cursor = self.cursor
        index = self.index[id(unit)]
        held = cursor is not None and index in cursor.held and unit.holds_gathered_weights
        if cursor is None or not is_zero3(unit) or held or all(
            g.state.value == "unsharded" for g in unit.groups if g.gathers
        ):
            if held:  # gathered before the phase on every rank: no entry of its own this time
                cursor.held.discard(index)
                cursor.recorded.append(index)
            unit.unshard()
            if cursor is not None and not cursor.flushed:
                self._issue_nested(index)
                self._prefetch_for(unit, explicit_only=True)
            return
        cursor.held.discard(index)
        cursor.recorded.append(index)
        if not cursor.flushed:
            entry = cursor.find(index)
            if entry is not None:
                for i in range(cursor.next, entry):
                    self._pass(i)
                self._issue(entry, own=True)
                cursor.next = entry + 1
                self._issue_nested(index)
                self._prefetch_for(unit)
                unit.unshard()
                self._drop_scratch()
                return
            self._flush()
        self._request(index)
        unit.unshard()

    def _default_sequence(self, phase: Phase) -> list[int]:
        agreed = self.sequences[phase]
        if agreed is not None:
            return agreed
        order = self.unit_order
        if phase is Phase.BACKWARD:  # reversed, but each unit before the units nested in it (its hook fires first)
            position = {u: p for p, u in enumerate(self.unit_order)}
            order = sorted(order, key=lambda i: [-position[a] for a in self._path(i)])
        return [i for i in order if self._in_phase(i, phase)]

    def _path(self, index: int) -> list[int]:
        """The units enclosing ``index``, outermost first, then ``index``."""
        path = [index]
        while self.parent[path[-1]] is not None:
            path.append(self.parent[path[-1]])
        return path[::-1]

    def _nested_in(self, index: int, parent: int) -> bool:
        """Unit ``index`` lies inside unit ``parent`` (at any depth)."""
        above = self.parent[index]
        while above is not None:
            if above == parent:
                return True
            above = self.parent[above]
        return False

    def _issue_nested(self, index: int) -> None:
        """Issue at once the entries right after this point that belong to units nested in ``index``.

        Units inside a unit may run on some ranks only (experts no token reached), and
        the model's own blocking collectives (an MoE all-to-all) may come between them:
        a rank that skips a nested unit must still have issued its all-gather before it
        can block there, so every rank issues them all as the enclosing unit starts, at a
        point every rank reaches (docs/design.md, section 5a). Not for the root: that
        would gather the whole model at once.
        """
        cursor = self.cursor
        if self.units[index].is_root:
            return
        last = cursor.next
        while last < len(cursor.sequence) and self._nested_in(cursor.sequence[last], index):
            last += 1
        while cursor.issued < last:
            self._issue(cursor.issued, own=True)

    def _complete(self, sequence: list[int], phase: Phase) -> list[int]:
        """``sequence`` with every nested unit rank 0 did not gather put in its enclosing unit's run.

        A unit that rank 0 skipped may run on another rank next time; with an entry of its
        own, right after its enclosing unit's, that rank finds it in the agreed sequence
        (no control round, which would wait for ranks blocked in the model's collectives).
        Each run is ordered as the units were first used (reversed in backward).
        """
        present = set(sequence)
        rank = {u: p for p, u in enumerate(self.unit_order)}
        if phase is Phase.BACKWARD:
            rank = {u: -p for u, p in rank.items()}
        missing = [i for i in range(len(self.units)) if i not in present and self._in_phase(i, phase)
                   and self.parent[i] is not None and not self.units[self.parent[i]].is_root]
        for index in sorted(missing, key=lambda i: rank[i]):
            parent = self.parent[index]
            if parent not in sequence:
                continue
            start = sequence.index(parent) + 1
            end = start
            while end < len(sequence) and self._nested_in(sequence[end], parent):
                end += 1
            run = sorted(sequence[start:end] + [index], key=lambda i: rank[i])
            sequence = sequence[:start] + run + sequence[end:]
        return sequence

    def _in_phase(self, index: int, phase: Phase) -> bool:
        """``index`` gathers in ``phase`` (ZeRO-3; in backward only if resharded after forward)."""
        unit = self.units[index]
        return is_zero3(unit) and (phase is Phase.FORWARD or (unit.reshard_after_forward and not unit.is_root))

    def _issue(self, entry: int, *, own: bool) -> None:
        cursor = self.cursor
        if entry < cursor.issued:
            return
        assert entry == cursor.issued, "all-gathers are issued in sequence order"
        unit = self.units[cursor.sequence[entry]]
        self._gather_log.append(cursor.sequence[entry])
        if own and self._idle(unit):
            for group in unit.groups:
                group.start_unshard()
            cursor.own.add(entry)
        else:
            cursor.scratch.extend(_participate(unit))
        cursor.issued = entry + 1

    @staticmethod
    def _idle(unit: FSDPUnit) -> bool:
        return all(g.state.value == "sharded" and g._gather is None for g in unit.groups if g.gathers)

    def _pass(self, entry: int) -> None:
        """This rank does not use ``entry``: issue it anyway (scratch) or release what it gathered."""
        cursor = self.cursor
        if entry >= cursor.issued:
            self._issue(entry, own=False)
        elif entry in cursor.own:
            self.units[cursor.sequence[entry]].reshard()

    def _prefetch_for(self, unit: FSDPUnit, *, explicit_only: bool = False) -> None:
        """Start the all-gathers ``unit`` prefetches: up to its explicit targets, else ``prefetch_depth`` entries.

        Explicit lists (``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``)
        choose how far ahead to gather: up to the furthest target's next entry in the
        agreed sequence. Entries are still issued in sequence order, never skipped,
        so every rank issues the same all-gathers in the same order whatever its lists
        (a target with no entry left is not prefetched; its use gathers it as usual).
        """
        cursor = self.cursor
        targets = unit.forward_prefetch if self.phase is Phase.FORWARD else unit.backward_prefetch
        if targets is None:
            if explicit_only:
                return
            self._prefetch(cursor.next + unit.prefetch_depth)
            return
        furthest = cursor.next - 1
        for target in targets:
            target_index = self.index.get(id(target))
            if target_index is None:
                raise ValueError(
                    f"the prefetch list of {self.describe(unit)} names a module that is not under this root "
                    f"({type(target.module).__name__}); list only fully_shard-ed modules of the same model"
                )
            entry = cursor.find(target_index)
            if entry is not None:
                furthest = max(furthest, entry)
        self._prefetch(furthest + 1)

    def prefetch_unit(self, unit: FSDPUnit) -> None:
        """An explicit ``unshard()`` inside a phase: issue the agreed sequence up to ``unit``'s next entry."""
        cursor = self.cursor
        if cursor is None or cursor.flushed or not is_zero3(unit) or unit.holds_gathered_weights:
            return
        entry = cursor.find(self.index[id(unit)])
        if entry is not None:
            self._prefetch(entry + 1)

    def _prefetch(self, limit: int) -> None:
        """Issue the sequence's entries before ``limit`` (in order; stops at a unit still busy)."""
        cursor = self.cursor
        while cursor.issued < min(limit, len(cursor.sequence)):
            if not self._idle(self.units[cursor.sequence[cursor.issued]]):
                return  # issued when consumed or passed, in order
            self._issue(cursor.issued, own=True)

    def _flush(self) -> None:
        cursor = self.cursor
        for i in range(cursor.next, len(cursor.sequence)):
            self._pass(i)
        cursor.next = len(cursor.sequence)
        cursor.flushed = True

    def _drop_scratch(self) -> None:
        cursor = self.cursor
        scratch, cursor.scratch = cursor.scratch, []
        for work in scratch:
            work.wait()

    def _request(self, index: int) -> None:
        """Gather ``index`` off the sequence: agreed with every rank in a control round."""
        result = self._round(active=True, request=index)
        self._gather_requested(result.requests, own=index)

    def _gather_requested(self, requests: list[int], own: int | None) -> None:
        for i in requests:  # ascending unit index: the same order everywhere
            unit = self.units[i]
            self._gather_log.append(i)
            if i == own and self._idle(unit):
                for group in unit.groups:
                    group.start_unshard()
            else:
                self.cursor.scratch.extend(_participate(unit))
        self._drop_scratch()

    def _close(self, flags: list[bool], extra: list[bool], keep: list[bool] | None = None,
               used: list[bool] | None = None) -> RoundResult:
        if self.cursor is not None:
            self._flush()
        while True:
            result = self._round(active=False, flags=flags, extra=extra, keep=keep, used=used)
            if not result.active:
                break
            self._gather_requested(result.requests, own=None)
        if self.cursor is not None:
            self._drop_scratch()
        return result

    def _among_own_ranks(self, flags: list[bool], agreed: list[bool]) -> list[bool]:
        """``agreed`` (a MAX over every rank), with each group over fewer ranks agreed among those only.

        Unit ``i`` holds different experts on different EP ranks: whether an expert unit
        received gradients is a question for its EDP group, or an expert no token reached
        anywhere in its EDP group would be given zero gradients (AdamW would then move it)
        where one process leaves it ``None``. Used only for what is installed; which
        collectives run stays agreed over every rank. Every rank issues these rounds
        alike, in group order, each on its own EDP group.
        """
        agreed = list(agreed)
        for process_group, members in self._own_rounds:
            local = torch.tensor([int(flags[i]) for i in members], dtype=torch.int64)
            if dist.get_world_size(process_group) > 1:
                on_device = local.to(self.device)
                with self.waiting_for("a control round of expert units (core/schedule.py)"):
                    all_reduce_max(on_device, process_group, comm=self.comm)
                local = on_device.cpu()
            for i, value in zip(members, local.tolist()):
                agreed[i] = bool(value)
        return agreed

    # -- control rounds -----------------------------------------------------
    def _round(self, *, active: bool, request: int | None = None, flags: list[bool] | None = None,
               extra: list[bool] | None = None, keep: list[bool] | None = None,
               used: list[bool] | None = None) -> RoundResult:
        n_units, n_groups = len(self.units), len(self.groups)
        n_params = sum(len(g.sharded_params) for g in self.groups)
        cap = 4 * n_units + 16
        payload = torch.zeros(1 + 2 * n_units + 2 * n_groups + 1 + cap + n_params + n_units + 4, dtype=torch.int64)
        drop = len(payload) - 4 - n_units  # per unit: 1 where this rank cannot keep its weights (MAX: any rank)
        bits = drop - n_params  # per parameter: 1 where this rank had a gradient for it (MAX: any rank)
        if used is not None:
            payload[bits:drop] = torch.tensor(used, dtype=torch.int64)
        if keep is not None:
            payload[drop:drop + n_units] = torch.tensor([not k for k in keep], dtype=torch.int64)
        payload[0] = int(active)
        if request is not None:
            payload[1 + request] = 1
        offset = 1 + n_units
        if flags is not None:
            payload[offset:offset + n_groups] = torch.tensor(flags, dtype=torch.int64)
        offset += n_groups
        if extra is not None:
            payload[offset:offset + n_groups] = torch.tensor(extra, dtype=torch.int64)
        offset += n_groups
        sequence = self.cursor.recorded[:cap] if self.cursor is not None else []
        if self.leader and not active:
            for position, unit_index in enumerate(self._first_use):
                payload[offset + unit_index] = position + 1
            payload[offset + n_units] = len(sequence)
            payload[offset + n_units + 1:offset + n_units + 1 + len(sequence)] = torch.tensor(
                [i + 1 for i in sequence], dtype=torch.int64)
        if not active:  # maxima of (d, -d): every rank learns the largest and the smallest digest
            gathers = _digest(self._gather_log)
            payload[-4:] = torch.tensor([gathers, -gathers, self._last_reduce_digest, -self._last_reduce_digest])
        if self.control is not None and dist.get_world_size(self.control) > 1:
            on_device = payload.to(self.device)
            with self.waiting_for("a control round (core/schedule.py)"):
                all_reduce_max(on_device, self.control, comm=self.comm)
            payload = on_device.cpu()
        self.control_rounds += 1
        values = payload.tolist()
        if not values[0]:
            self._check_in_step(*values[-4:])
        length = values[offset + n_units]
        return RoundResult(
            active=bool(values[0]),
            requests=[i for i in range(n_units) if values[1 + i]],
            flags=[bool(v) for v in values[1 + n_units:1 + n_units + n_groups]],
            extra=[bool(v) for v in values[1 + n_units + n_groups:offset]],
            order=values[offset:offset + n_units],
            sequence=[v - 1 for v in values[offset + n_units + 1:offset + n_units + 1 + length]],
            kept=[keep is not None and not v for v in values[drop:drop + n_units]],
            used=[bool(v) for v in values[bits:drop]],
        )

    def _check_in_step(self, gathers_max: int, gathers_neg_min: int, reduces_max: int, reduces_neg_min: int) -> None:
        """Raise on every rank if the ranks issued different collectives (see ``_gather_log``)."""
        for what, high, neg_low in (("all-gathers in this " + (self.phase.value if self.phase else "step"),
                                     gathers_max, gathers_neg_min),
                                    ("gradient reductions in the last backward", reduces_max, reduces_neg_min)):
            if high != -neg_low:
                cls = type(self.units[0].module)
                root = cls.__bases__[-1].__name__  # the model's own class, not its FSDP subclass
                raise RuntimeError(
                    f"collectives out of step across ranks under {root}: the ranks issued different {what}. "
                    "Every rank must call the sharded model's forward and backward (and start_grad_sync) the same "
                    "number of times; if they did, this is a bug in megatron_fsdp's schedule: please report it"
                )

    def _agree_unit_order(self, positions: list[int]) -> None:
        """Rank 0's first-use order; a unit it did not run goes after its nearest run predecessor."""
        if not any(positions):
            return
        keys, last = [], 0.0
        for i, position in enumerate(positions):
            last = float(position) if position else last
            keys.append((position if position else last + 0.5, i))
        self.unit_order = [i for _, i in sorted(keys)]

    # -- reductions ---------------------------------------------------------
    def reduce_pending(self, units: list[FSDPUnit]) -> None:
        """Outside a backward (after ``no_sync``): reduce what any rank accumulated for ``units``.

        The groups to reduce are agreed in a control round; each is reduced in the
        agreed order, with zeros from the ranks that hold nothing for it.
        """
        chosen = {id(g) for u in units for g in u.groups}
        # A partial sum held for dp_outer (non-last micro-batches) is pending too: reduced with zeros
        # inside dp_shard (every rank of the group takes part), then once across dp_outer.
        pending = [id(g) in chosen and g.requires_grad and (g.holds_grads or g.partial_outer is not None)
                   for g in self.groups]
        result = self._round(active=False, extra=pending)
        order = [g for i in reversed(self.unit_order) for g in self.units[i].groups]
        self._reduce_log = []
        for group in order:
            if result.extra[self.group_index[id(group)]]:
                self._reduce(group, install=True, defer_outer=False)
        self._last_reduce_digest = _digest(self._reduce_log)

    def advance_reductions(self) -> None:
        """Issue the reductions whose turn has come, in the agreed order.

        A group's turn comes once its gradients are complete, or at once where its
        unit did not run with grad on this rank (it contributes zeros, or what earlier
        micro-batches accumulated).
        """
        if self.phase is not Phase.BACKWARD:
            return
        while self._reduce_next < len(self._reduce_order):
            group = self._reduce_order[self._reduce_next]
            if not (group.grads_complete or self.unit_of[id(group)].forward_grad_calls == 0):
                return
            self._reduce_next += 1
            self._reduce(group)

    def _reduce(self, group: ParamGroup, *, install: bool = False, defer_outer: bool | None = None) -> None:
        """Reduce ``group`` now (zeros if nothing is here); ``install``: some rank surely had gradients.

        ``defer_outer``: hold the HSDP outer stage (None: as the group's unit says, in a backward).
        """
        if group.holds_grads or group.partial_outer is not None:
            group.received_grads = True  # real contributions here (this backward or accumulated)
        unit = self.unit_of[id(group)]
        defer = unit.defers_outer_now if defer_outer is None else defer_outer
        reduce = group.reduce_grads(True, unit.grad_scaling, zeros_if_none=True, defer_outer=defer)
        reduce.defer_install = not (install or group.received_grads)
        self._track(reduce)
        self._issued.add(self.group_index[id(group)])
        self._reduce_log.append(self.group_index[id(group)])


def _own_round_groups(groups: list[ParamGroup], control_ranks: list[int],
                      ) -> list[tuple[dist.ProcessGroup, list[int]]]:
    """Per rank set smaller than the control round's: a group copy over it and the parameter groups on it."""
    by_ranks: dict[tuple[int, ...], list[int]] = {}
    for i, group in enumerate(groups):
        ranks = tuple(sorted(group.dp.mesh.mesh.flatten().tolist()))
        if ranks != tuple(sorted(control_ranks)):
            by_ranks.setdefault(ranks, []).append(i)
    return [(group_copy("control", groups[members[0]].dp.shard_group, list(ranks)), members)
            for ranks, members in by_ranks.items()]


def _enclosing_units(units: list[FSDPUnit]) -> list[int | None]:
    """Per unit, the index of the nearest other unit whose modules contain its module (None: none)."""
    owner = {id(m): i for i, u in enumerate(units) for m in u.modules}
    parent_module: dict[int, torch.nn.Module] = {}
    for unit in units:
        for module in unit.modules:
            for outer in module.modules():
                for child in outer.children():
                    parent_module.setdefault(id(child), outer)
    enclosing: list[int | None] = []
    for i, unit in enumerate(units):
        found = None
        module = parent_module.get(id(unit.module))
        while module is not None:
            if owner.get(id(module), i) != i:
                found = owner[id(module)]
                break
            module = parent_module.get(id(module))
        enclosing.append(found)
    return enclosing


def _digest(log: list[int]) -> int:
    """A digest of a sequence of indices, the same on every rank for the same sequence (< 2**62)."""
    value = len(log)
    for item in log:
        value = (value * 1_000_003 + item + 1) % ((1 << 61) - 1)
    return value
