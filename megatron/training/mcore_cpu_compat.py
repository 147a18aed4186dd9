"""megatron-core 0.16.1 on CPU: the few CUDA-only calls of its GPT path (dense and MoE), redirected to the CPU.

megatron-core builds and trains its ``GPTModel`` (local layer spec) on CPU except
where it names CUDA outright. ``apply_cpu_compat()`` redirects exactly those
places, and only when CUDA is absent; on a CUDA machine megatron-core runs as
shipped. Each ``Patch`` names the megatron-core file and line it replaces and
the text expected there: ``stale_patches()`` (run by the tests, and before
patching) reports any patch whose line no longer reads as expected, so a new
megatron-core version fails loudly instead of being patched blindly.

How each CUDA call is redirected:

- ``torch.cuda.current_device()`` as an allocation device (global memory buffer,
  sequence-parallel gathers, DDP grad buffers, RoPE and MLA's yarn RoPE, the MoE router): the module's ``torch`` name is
  bound to ``_CPUTorch``, which is torch except that ``torch.cuda.current_device()``
  answers ``"cpu"`` (torch itself is not touched);
- the causal masks allocated on ``device="cuda"``: CPU versions of the two functions;
- the alltoall token dispatcher's side stream (``torch.cuda.Stream``, ``current_stream``,
  ``stream``): one CPU stand-in stream whose waits are no-ops and whose events have completed
  (CPU work is synchronous), through the same ``torch`` binding;
- ``moe_utils.te_general_gemm``, bound only when TransformerEngine imports: ``None``;
- ``multi_latent_attention.HAVE_TE``, True without TransformerEngine (a mock stands in): ``False``;
- RoPE's per-CP-rank positions (``rope_utils.get_pos_emb_on_this_cp_rank``: pinned memory copied to CUDA): the
  same chunks indexed on the host, bound where RoPE and yarn RoPE imported it;
- the RNG tracker (``tensor_parallel/random.py``): its states become CPU generator
  states, so ``model_parallel_cuda_manual_seed`` seeds one per TP rank (seed + 2718
  + tp_rank) and ``get_cuda_rng_tracker().fork()`` switches the CPU generator to it
  for attention dropout, as it switches the CUDA generator on GPUs.

This is front-end code (the library never patches megatron-core); docs/megatron.md.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types
from dataclasses import dataclass

import torch

MCORE_VERSION = "0.16.1"  # the release every patch below was written against

_applied = False


class _CPUEvent:
    """A CUDA event on CPU: CPU work is done when it returns, so every event has completed."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CPUStream:
    """A CUDA stream on CPU: one ordered stream of work, so waits are no-ops and events are complete."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _CPUEvent:
        return event if event is not None else _CPUEvent()

    def synchronize(self) -> None:
        pass


_CURRENT_STREAM = _CPUStream()


class _CPUCuda:
    """``torch.cuda`` as seen by a patched megatron-core module: the CPU is the current device and stream."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"

    # tensor_parallel/random.py seeds and reads "the" generator: on CPU that is the default CPU generator.
    get_rng_state = staticmethod(torch.get_rng_state)
    manual_seed = staticmethod(torch.manual_seed)

    # The alltoall token dispatcher's device-to-host side stream (token counts for the all-to-all's splits).
    Stream = _CPUStream
    Event = _CPUEvent

    @staticmethod
    def current_stream(device=None) -> _CPUStream:
        return _CURRENT_STREAM

    @staticmethod
    def stream(stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _CPUTorch(types.ModuleType):
    """``torch`` as seen by a patched megatron-core module: everything but ``torch.cuda`` is torch's own."""

    cuda = _CPUCuda()

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)


_CPU_TORCH = _CPUTorch()


def _get_cpu_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """``_get_cuda_rng_state`` on CPU: the default CPU generator's state (always a fresh copy)."""
    if graph_safe:
        raise RuntimeError("CUDA-graph-safe RNG states (use_cudagraphable_rng / --te-rng-tracker) need CUDA")
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """``_set_cuda_rng_state`` on CPU (megatron-core's queues the call lazily on a CPU build: it never runs)."""
    if graph_safe:
        raise RuntimeError("CUDA-graph-safe RNG states (use_cudagraphable_rng / --te-rng-tracker) need CUDA")
    torch.set_rng_state(new_state)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """``get_default_causal_mask`` on CPU: True above the diagonal (masked)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    """``get_sliding_window_causal_mask`` on CPU, the same bands as megatron-core's."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    upper = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


def _cpu_maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` on CPU: the tensor is on the host already, and ``as_numpy`` still
    turns the alltoall dispatcher's split sizes into the host arrays ``all_to_all_single`` takes."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """``rope_utils.get_pos_emb_on_this_cp_rank`` on CPU: the same chunks (``r`` and ``2 C - 1 - r`` of ``2 C``), its
    index built on the embedding's device (megatron-core pins it in host memory and copies it to CUDA)."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


class _DropForkWarning(logging.Filter):
    """random.py's fork() warns when the CPU generator moved inside it: on CPU that is the tracked state moving."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


@dataclass(frozen=True)
class CPUAutocastRewrap:
    """A replacement computed from what it replaces: megatron-core's tensor-parallel linear autograd functions are
    wrapped by ``torch.amp.custom_fwd/custom_bwd(device_type="cuda")``, so under CPU autocast (bf16 DDP on CPU) their
    backward runs outside autocast and mixes bf16 and fp32 matmuls. The function under that wrapper
    (``__wrapped__``) is wrapped again for ``device_type="cpu"``: the forward records CPU autocast's state, the
    backward runs under it, as the CUDA wrapper does on GPUs."""

    kind: str  # "fwd" or "bwd"

    def __call__(self, decorated):
        wrap = torch.amp.custom_fwd if self.kind == "fwd" else torch.amp.custom_bwd
        return staticmethod(wrap(decorated.__wrapped__, device_type="cpu"))


@dataclass(frozen=True)
class Patch:
    """One redirection: ``module.target`` (dotted) becomes ``replacement``.

    ``lines`` are the 1-based line numbers in megatron-core 0.16.1's ``path``
    (relative to ``megatron/core``) and ``expected`` the text each must contain:
    the CUDA calls this patch stands in for.
    """

    module: str
    target: str
    path: str
    lines: tuple[int, ...]
    expected: str
    replacement: object
    adds: bool = False  # the target is missing from megatron-core (a bug) and is added, not replaced

    def describe(self) -> str:
        return f"megatron/core/{self.path}:{','.join(map(str, self.lines))} ({self.expected})"


def _torch_patch(module: str, path: str, lines: tuple[int, ...]) -> Patch:
    return Patch(module, "torch", path, lines, "torch.cuda.current_device()", _CPU_TORCH)


PATCHES: tuple[Patch, ...] = (
    # GlobalMemoryBuffer.get_tensor allocates on the current CUDA device (sequence-parallel gathers).
    _torch_patch("megatron.core.utils", "utils.py", (631,)),
    # Sequence-parallel gather / reduce-scatter outputs; the MoE alltoall dispatcher's all-to-all output.
    _torch_patch("megatron.core.tensor_parallel.mappings", "tensor_parallel/mappings.py", (91, 141, 148, 181, 442)),
    # LinearWithGradAccumulationAndAsyncCommunication's sequence-parallel all-gather buffer.
    _torch_patch("megatron.core.tensor_parallel.layers", "tensor_parallel/layers.py", (552,)),
    # megatron-core DDP's contiguous param and grad buffers.
    _torch_patch("megatron.core.distributed.param_and_grad_buffer", "distributed/param_and_grad_buffer.py",
                 (783, 800, 806)),
    # RoPE moves its inverse frequencies to the current CUDA device at the first forward.
    _torch_patch("megatron.core.models.common.embeddings.rotary_pos_embedding",
                 "models/common/embeddings/rotary_pos_embedding.py", (162,)),
    # Multi-latent attention's yarn RoPE moves its two CPU-built inverse-frequency tables to the current CUDA device
    # at the first forward.
    _torch_patch("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
                 "models/common/embeddings/yarn_rotary_pos_embedding.py", (122, 126)),
    # MoE: the router moves a CPU-resident gate to the current CUDA device, and allocates its aux-loss state there.
    _torch_patch("megatron.core.transformer.moe.router", "transformer/moe/router.py", (90, 92, 169, 178, 192, 198)),
    # MoE alltoall dispatcher: a torch.cuda.Stream built at construction, and the side-stream copy of the token
    # counts to the host (already on the host here: maybe_move_tensor_to_cpu leaves CPU tensors as they are).
    Patch("megatron.core.transformer.moe.token_dispatcher", "torch", "transformer/moe/token_dispatcher.py",
          (445, 871, 873, 874), "torch.cuda.", _CPU_TORCH),
    # ... and its host copies of the split sizes: CUDA tensors only (`tensor.is_cuda`), so on CPU they stayed
    # tensors, which all_to_all_single refuses as split sizes.
    Patch("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
          "transformer/moe/moe_utils.py", (1093,), "tensor.is_cuda", _cpu_maybe_move_tensor_to_cpu),
    # moe_utils.py binds te_general_gemm only inside its TransformerEngine `try` (megatron-core 0.16.1 bug): without
    # TE the router's gating linear raises NameError. None is what its own `if te_general_gemm is not None` expects.
    Patch("megatron.core.transformer.moe.moe_utils", "te_general_gemm", "transformer/moe/moe_utils.py", (1192,),
          "if te_general_gemm is not None", None, adds=True),
    # multi_latent_attention.py sets HAVE_TE = True whenever megatron.core.extensions.transformer_engine imports,
    # which it does without TransformerEngine (te is a MagicMock there, so TELinear is a MagicMock, not a class):
    # MLASelfAttention.__init__'s isinstance(self.linear_proj, TELinear) then raises TypeError. Without CUDA there is
    # no TransformerEngine, so False is the truth.
    Patch("megatron.core.transformer.multi_latent_attention", "HAVE_TE", "transformer/multi_latent_attention.py",
          (62,), "HAVE_TE = True", False),
    Patch("megatron.core.transformer.utils", "get_default_causal_mask", "transformer/utils.py", (35,),
          'device="cuda"', _cpu_default_causal_mask),
    Patch("megatron.core.transformer.utils", "get_sliding_window_causal_mask", "transformer/utils.py", (40,),
          'device="cuda"', _cpu_sliding_window_causal_mask),
    # fused_softmax.py imported both mask functions by name; its copies are the ones attention calls.
    Patch("megatron.core.fusions.fused_softmax", "get_default_causal_mask", "fusions/fused_softmax.py", (8, 327),
          "get_default_causal_mask", _cpu_default_causal_mask),
    Patch("megatron.core.fusions.fused_softmax", "get_sliding_window_causal_mask", "fusions/fused_softmax.py",
          (8, 322), "get_sliding_window_causal_mask", _cpu_sliding_window_causal_mask),
    # The RNG tracker: torch.cuda.get_rng_state / manual_seed in CudaRNGStatesTracker.add and
    # model_parallel_cuda_manual_seed read and seed the CPU generator instead.
    Patch("megatron.core.tensor_parallel.random", "torch", "tensor_parallel/random.py", (235, 237, 238, 422),
          "torch.cuda.", _CPU_TORCH),
    Patch("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "tensor_parallel/random.py", (55,),
          "torch.cuda.random.get_rng_state(device=device)", _get_cpu_rng_state),
    Patch("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", "tensor_parallel/random.py", (84,),
          "_cuda_setRNGState", _set_cpu_rng_state),
    # The linear layers' autograd functions restore only CUDA's autocast state in their backward (custom_bwd with
    # device_type="cuda"): on CPU, --bf16 under DDP (autocast) failed in their backward (CPUAutocastRewrap).
    *(Patch("megatron.core.tensor_parallel.layers", f"{cls}.{method}", "tensor_parallel/layers.py", (line,),
            f"@custom_{kind}", CPUAutocastRewrap(kind))
      for cls, lines in (("LinearWithFrozenWeight", (335, 347)),
                         ("LinearWithGradAccumulationAndAsyncCommunication", (447, 494)))
      for method, kind, line in zip(("forward", "backward"), ("fwd", "bwd"), lines)),
    # Context parallelism: RoPE (and MLA's yarn RoPE) keep this CP rank's positions through
    # rope_utils.get_pos_emb_on_this_cp_rank, whose chunk index is pinned host memory copied to CUDA; both modules
    # imported it by name, and their copies are the ones called.
    *(Patch(f"megatron.core.models.common.embeddings.{module}", "get_pos_emb_on_this_cp_rank",
            "models/common/embeddings/rope_utils.py", (64,), ".cuda(non_blocking=True)", _cpu_pos_emb_on_this_cp_rank)
      for module in ("rotary_pos_embedding", "yarn_rotary_pos_embedding")),
)

# Not a replacement: a log filter on the fork() warning at this line (see _DropForkWarning).
FORK_WARNING = ("tensor_parallel/random.py", 265, "CPU RNG state changed within GPU RNG context")


def installed_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def _mcore_root() -> str:
    import megatron.core

    return megatron.core.__path__[0]


def _source_lines(path: str) -> list[str]:
    with open(f"{_mcore_root()}/{path}", encoding="utf-8") as f:
        return f.read().splitlines()


def stale_patches(patches: tuple[Patch, ...] = PATCHES) -> list[str]:
    """Every patch (and the fork-warning filter) whose megatron-core line no longer reads as expected."""
    problems = []
    version = installed_version()
    if version != MCORE_VERSION:
        problems.append(f"megatron-core {version} is installed; these patches are for {MCORE_VERSION}")
    checks = [(p.path, line, p.expected, p.describe()) for p in patches for line in p.lines]
    path, line, text = FORK_WARNING
    checks.append((path, line, text, f"megatron/core/{path}:{line} (fork warning)"))
    for path, line, expected, what in checks:
        lines = _source_lines(path)
        found = lines[line - 1] if line <= len(lines) else "<past the end of the file>"
        if expected not in found:
            problems.append(f"{what}: line {line} now reads {found.strip()!r}")
    for patch in patches:
        module = importlib.import_module(patch.module)
        owner, _, attr = patch.target.rpartition(".")
        holder = _resolve(module, owner)
        if patch.adds and hasattr(holder, attr) and not _applied:
            problems.append(f"{patch.describe()}: {patch.module}.{patch.target} now exists (fixed upstream?)")
        elif not patch.adds and not hasattr(holder, attr):
            problems.append(f"{patch.describe()}: {patch.module}.{patch.target} no longer exists")
    return problems


def _resolve(module: types.ModuleType, dotted: str):
    holder = module
    for part in filter(None, dotted.split(".")):
        holder = getattr(holder, part)
    return holder


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_compat() -> bool:
    """Redirect megatron-core 0.16.1's CUDA-only calls to the CPU when CUDA is absent; True if patched now.

    Idempotent. Raises, naming the lines, when the installed megatron-core is not
    the version the patches were written against or a patched line has changed.
    """
    global _applied
    if _applied or not cuda_absent():
        return False
    problems = stale_patches()
    if problems:
        raise RuntimeError(
            f"megatron-core on CPU goes through megatron/training/mcore_cpu_compat.py, written for megatron-core "
            f"{MCORE_VERSION}; it does not fit the installed copy: " + "; ".join(problems)
            + f". Install megatron-core=={MCORE_VERSION}, or run on CUDA"
        )
    for patch in PATCHES:
        owner, _, attr = patch.target.rpartition(".")
        holder = _resolve(importlib.import_module(patch.module), owner)
        replacement = patch.replacement
        if isinstance(replacement, CPUAutocastRewrap):
            replacement = replacement(getattr(holder, attr))
        setattr(holder, attr, replacement)
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropForkWarning())
    _applied = True
    return True


__all__ = ["MCORE_VERSION", "PATCHES", "Patch", "apply_cpu_compat", "cuda_absent", "stale_patches"]
