"""Context parallelism on megatron-core's GPTModel: pretrain_gpt.py at CP2 x DP2 and TP2 x CP2 against DP4.

The front-end's CP core attention (megatron/training/mcore_cp_attention.py) in megatron-core's local
layer spec, megatron-core's parallel_state initialised with the CP size, RoPE's per-CP-rank positions
(megatron-core's own, through the CPU compatibility layer) and the loop's CP split of each micro-batch.
With dropout off a CP run computes the DP run's model on the same global batches: every iteration's
loss and gradient norm within 1e-5 relative (another order of sums: gradient accumulation over two
micro-batches, the reduce-scatter of K/V gradients). Runs in test_mcore_model.py's 4-rank group, after
mcore_model_checks' suite (one launch).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tests.distributed.harness import check

SUITE = "mcore_cp"

# GQA (4 heads, 2 query groups), SwiGLU, RMSNorm, an untied output layer; fp32, dropout off; 4 micro-batches of one
# sample per iteration (DP4: one each; CP2 x DP2: two per data-parallel rank).
MODEL = ["--mock-data", "--vocab-size", "120", "--make-vocab-size-divisible-by", "64", "--num-layers", "2",
         "--hidden-size", "16", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
         "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-2", "--swiglu",
         "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights", "--use-megatron-fsdp",
         "--data-parallel-sharding-strategy", "optim_grads_params", "--eval-iters", "1"]
COMMON = [*MODEL, "--attention-dropout", "0", "--hidden-dropout", "0", "--train-iters", "5", "--eval-interval", "5",
          "--ckpt-format", "fsdp_dtensor"]


def _shared_dir() -> str:
    """A fresh directory every rank sees (rank 0's, broadcast)."""
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    return holder[0]


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _pretrain(argv: list[str], inspect=None):
    """pretrain() with pretrain_gpt's model provider; ``inspect(layout)`` runs once the model is built (megatron-core's
    parallel_state is then initialised for this run)."""
    from megatron.training import training
    from pretrain_gpt import forward_step, model_provider

    real = training.build_backend

    def build_backend(args, provider, device, layout):
        backend = real(args, provider, device, layout)
        if inspect is not None:
            inspect(layout, backend.module)
        return backend

    log = io.StringIO()
    training.build_backend = build_backend
    try:
        with contextlib.redirect_stdout(log):
            run = training.pretrain(model_provider, forward_step, argv)
    finally:
        training.build_backend = real
    return run, log.getvalue()


def _assert_close_runs(what: str, got, want) -> None:
    """Every iteration's loss and grad norm, and the final validation loss, within 1e-5 relative (rank 0 prints the
    largest relative differences: the figures docs/parallelism.md quotes)."""
    assert sorted(got.losses) == sorted(want.losses) and want.losses, (got.losses, want.losses)
    if dist.get_rank() == 0:
        loss = max(abs(got.losses[i] - want.losses[i]) / abs(want.losses[i]) for i in want.losses)
        norm = max(abs(got.grad_norms[i] - want.grad_norms[i]) / abs(want.grad_norms[i]) for i in want.losses)
        print(f"{what}: max relative difference over {len(want.losses)} iterations: loss {loss:.2g}, "
              f"grad norm {norm:.2g}", flush=True)
    for it in want.losses:
        for name, a, b in (("loss", got.losses[it], want.losses[it]), ("grad norm", got.grad_norms[it],
                                                                          want.grad_norms[it])):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=0,
                                       msg=lambda m, n=name, i=it: f"{what}: {n} at iteration {i}: {m}")
    torch.testing.assert_close(torch.tensor(got.final_valid_loss), torch.tensor(want.final_valid_loss), rtol=1e-5,
                               atol=0, msg=lambda m: f"{what}: final validation loss: {m}")


def _check_layout(tp: int, cp: int):
    """megatron-core's groups equal the front-end's layout (TP fastest, then CP, then DP) and the model's attention is
    the CP one (the loop splits each micro-batch with megatron-core's ``get_batch_on_this_cp_rank`` itself)."""

    def inspect(layout, module) -> None:
        from megatron.training.mcore_cp_attention import ContextParallelDotProductAttention

        rank, world = dist.get_rank(), dist.get_world_size()
        assert _ranks(parallel_state.get_context_parallel_group()) == _ranks(layout.cp.group)
        assert _ranks(parallel_state.get_context_parallel_group()) == [
            r for r in range(world) if r // (tp * cp) == rank // (tp * cp) and r % tp == rank % tp]
        assert _ranks(parallel_state.get_tensor_model_parallel_group()) == _ranks(layout.tp.group)
        assert _ranks(parallel_state.get_data_parallel_group()) == _ranks(layout.dp_group)
        assert _ranks(parallel_state.get_data_parallel_group(with_context_parallel=True)) == _ranks(layout.grad_group)
        assert layout.cp.rank == parallel_state.get_context_parallel_rank()
        assert module.config.context_parallel_size == cp
        cores = [layer.self_attention.core_attention for layer in module.decoder.layers]
        assert all(isinstance(c, ContextParallelDotProductAttention) for c in cores), cores
        assert all(_ranks(c.cp_group) == _ranks(layout.cp.group) for c in cores)

    return inspect


@check(SUITE, world_sizes=(4,))
def context_parallel_2_equals_data_parallel_4() -> None:
    """CP2 x DP2 trains megatron-core's GPTModel as DP4 does (RoPE and learned-absolute positions, GQA; multi-latent
    attention with its RoPE), and TP2 x CP2 (with and without sequence parallelism) as well: losses and grad
    norms within 1e-5 relative. A CP2 x DP2 checkpoint resumes at DP4 on DP4's curve."""
    root = _shared_dir()
    for positions in ("rope", "learned_absolute"):
        flags = [*COMMON, "--position-embedding-type", positions]
        data_parallel, log = _pretrain(flags)
        assert "building megatron-core GPTModel" in log or dist.get_rank() != 0, log[:2000]
        saves = ["--save", os.path.join(root, positions), "--save-interval", "3"] if positions == "rope" else []
        context_parallel, log = _pretrain([*flags, "--context-parallel-size", "2", *saves], _check_layout(1, 2))
        assert "building megatron-core GPTModel" in log or dist.get_rank() != 0, log[:2000]
        assert "data-parallel 2 x context-parallel 2 x tensor-parallel 1" in log or dist.get_rank() != 0, log[:2000]
        _assert_close_runs(f"CP2 x DP2 vs DP4, {positions}", context_parallel, data_parallel)
        if positions == "rope":
            # the CP2 x DP2 checkpoint of iteration 3 resumed at DP4 continues DP4's curve (CP holds no state)
            resumed, _ = _pretrain([*flags, "--load", os.path.join(root, positions, "iter_0000003")])
            assert sorted(resumed.losses) == [4, 5], resumed.losses
            for it in (4, 5):
                torch.testing.assert_close(torch.tensor(resumed.losses[it]), torch.tensor(data_parallel.losses[it]),
                                           rtol=1e-5, atol=0, msg=lambda m, i=it: f"CP2 x DP2 -> DP4 at {i}: {m}")
            mla = ["--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "8", "--qk-head-dim", "6",
                   "--qk-pos-emb-head-dim", "2", "--v-head-dim", "5", "--rotary-scaling-factor", "1.0", "--mscale",
                   "1.0", "--mscale-all-dim", "1.0", "--qk-layernorm"]
            without_gqa = [f for f in flags if f != "--group-query-attention"]  # MLA has no query groups
            mla_data_parallel, _ = _pretrain([*without_gqa, *mla])
            mla_context_parallel, _ = _pretrain([*without_gqa, *mla, "--context-parallel-size", "2"])
            _assert_close_runs("MLA CP2 x DP2 vs DP4", mla_context_parallel, mla_data_parallel)
            for extra in ([], ["--sequence-parallel"]):
                both, _ = _pretrain([*flags, "--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                     *extra], _check_layout(2, 2))
                _assert_close_runs(f"TP2 x CP2 {extra} vs DP4", both, data_parallel)


@check(SUITE, world_sizes=(4,))
def context_parallel_with_dropout_trains_and_resumes() -> None:
    """CP2 x DP2 with Megatron's default dropout (attention dropout under megatron-core's RNG tracker): the loss
    falls, and an fsdp_dtensor checkpoint at iteration 3 resumes bitwise (the tracker's states travel with it)."""
    root = _shared_dir()
    flags = [*MODEL, "--train-iters", "6", "--context-parallel-size", "2", "--ckpt-format", "fsdp_dtensor",
             "--position-embedding-type", "rope"]
    full, _ = _pretrain(flags)
    losses = [full.losses[i] for i in sorted(full.losses)]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    ckpt = os.path.join(root, "ckpt")
    _pretrain([*flags, "--save", ckpt, "--save-interval", "3", "--exit-interval", "3"])
    resumed, _ = _pretrain([*flags, "--load", ckpt])
    for it in (4, 5, 6):
        assert resumed.losses[it] == full.losses[it], (it, resumed.losses, full.losses)


@check(SUITE, world_sizes=(4,), params={"heads": ["gqa", "mla"]})
def core_attention_equals_whole_sequence_attention(heads: str) -> None:
    """The CP core attention alone at CP2 x DP2: this rank's rows of softmax(q k^T * scale, causal) v over the whole
    sequence, and the whole-sequence gradients of its queries, keys and values (all-gather / reduce-scatter), within
    1e-5; GQA (4 heads, 2 groups), or MLA's head sizes (query/key 8, value 5) with a given softmax scale."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.mcore_cp_attention import ContextParallelDotProductAttention, sequence_positions
    from megatron.training.mcore_model import initialize_mcore_parallel, transformer_config_from_args

    argv = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads",
            "4", "--seq-length", "16", "--context-parallel-size", "2", "--attention-dropout", "0"]
    if heads == "gqa":
        argv += ["--group-query-attention", "--num-query-groups", "2"]
    args = validate_args(parse_args(argv), dist.get_world_size())
    initialize_mcore_parallel(args, args.seed)
    config = transformer_config_from_args(args)
    k_dim, v_dim, groups, scale = (4, 4, 2, None) if heads == "gqa" else (8, 5, 4, 0.3)
    core = ContextParallelDotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=scale,
                                              k_channels=None if heads == "gqa" else k_dim,
                                              v_channels=None if heads == "gqa" else v_dim)
    g = torch.Generator().manual_seed(11)
    seq, batch = 16, 2
    q, k, v = (torch.randn(seq, batch, n, d, generator=g) for n, d in ((4, k_dim), (groups, k_dim), (groups, v_dim)))
    weight = torch.randn(seq, batch, 4 * v_dim, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    query_key_value = [full[0], *(t.repeat_interleave(4 // groups, dim=2) for t in full[1:])]
    reference = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in query_key_value), is_causal=True,
        scale=scale if scale is not None else k_dim ** -0.5).permute(2, 0, 1, 3).reshape(seq, batch, 4 * v_dim)
    (reference * weight).sum().backward()
    rows = sequence_positions(seq, 2, parallel_state.get_context_parallel_rank())
    local = [t.index_select(0, rows).clone().requires_grad_() for t in (q, k, v)]
    out = core(*local, None)
    torch.testing.assert_close(out, reference.detach().index_select(0, rows), rtol=1e-5, atol=1e-6)
    (out * weight.index_select(0, rows)).sum().backward()
    for name, mine, whole in zip("qkv", local, full):
        torch.testing.assert_close(mine.grad, whole.grad.index_select(0, rows), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{heads}: gradient of {n}: {m}")
