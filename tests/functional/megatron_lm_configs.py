"""Megatron-LM's 8 FSDP functional-test command lines, and their CPU-sized versions run by the functional suite.

``MEGATRON_LM`` holds each configuration's ``MODEL_ARGS`` as Megatron-LM's repository has them
(``tests/functional_tests/test_cases/{gpt,moe}/<name>/model_config.yaml``; YAML ``true`` written as the
bare flag, ``${...}`` placeholders kept). ``cpu_scaled`` turns one into a command line for a few gloo
ranks: sizes and data scaled down, and each GPU-only flag replaced by its CPU equivalent or dropped, by
the rules of ``SCALED`` and ``REPLACED`` (docs/megatron.md lists them). The functional suite runs every
configuration on megatron-core's ``GPTModel``, the front-end's only model: the dense ones with its
tensor-parallel layers, the MoE ones with its MoE layers (under TP, with --calculate-per-token-loss), which
take the shared-expert and router flags; the DeepSeek
proxies' multi-latent attention runs through the front-end's CPU MLA spec (``megatron/training/mcore_mla.py``).
"""

from __future__ import annotations

MEGATRON_LM: dict[str, str] = {
    "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor": (
        "--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad "
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --log-memory-to-tensorboard "
        "--tensorboard-dir ${TENSORBOARD_PATH} --micro-batch-size 4 --global-batch-size 32 --seq-length 1024 "
        "--max-position-embeddings 1024 --train-iters 100 --timing-log-level 0 --lr-decay-iters 320000 --save "
        "${CHECKPOINT_SAVE_PATH} --load ${CHECKPOINT_LOAD_PATH} --data-path "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document --vocab-file "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json --merge-file "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt --split 949,50,1 --distributed-backend "
        "nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 "
        "--lr-warmup-fraction 0.01 --log-interval 1 --save-interval 50 --eval-interval 1000 --eval-iters 10 "
        "--transformer-impl transformer_engine --tensor-model-parallel-size 2 --use-megatron-fsdp "
        "--calculate-per-token-loss --data-parallel-sharding-strategy optim_grads_params "
        "--use-distributed-optimizer --deterministic-mode --no-gradient-accumulation-fusion "
        "--megatron-fsdp-main-params-dtype fp32 --megatron-fsdp-main-grads-dtype fp32 "
        "--megatron-fsdp-grad-comm-dtype fp32 --attention-softmax-in-fp32 --use-checkpoint-opt_param-scheduler "
        "--use-mcore-models --ckpt-format fsdp_dtensor --data-cache-path ${DATA_CACHE_PATH} --bf16 --async-save "
        "--use-persistent-ckpt-worker "
    ),
    "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor_1node": (
        "--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad "
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --log-memory-to-tensorboard "
        "--tensorboard-dir ${TENSORBOARD_PATH} --micro-batch-size 4 --global-batch-size 32 --seq-length 1024 "
        "--max-position-embeddings 1024 --train-iters 100 --timing-log-level 0 --lr-decay-iters 320000 --save "
        "${CHECKPOINT_SAVE_PATH} --load ${CHECKPOINT_LOAD_PATH} --data-path "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document --vocab-file "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json --merge-file "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt --split 949,50,1 --distributed-backend "
        "nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 "
        "--lr-warmup-fraction 0.01 --log-interval 1 --save-interval 50 --eval-interval 1000 --eval-iters 10 "
        "--transformer-impl transformer_engine --tensor-model-parallel-size 2 --use-megatron-fsdp "
        "--calculate-per-token-loss --data-parallel-sharding-strategy optim_grads_params "
        "--use-distributed-optimizer --deterministic-mode --no-gradient-accumulation-fusion "
        "--megatron-fsdp-main-params-dtype fp32 --megatron-fsdp-main-grads-dtype fp32 "
        "--megatron-fsdp-grad-comm-dtype fp32 --attention-softmax-in-fp32 --use-checkpoint-opt_param-scheduler "
        "--use-mcore-models --ckpt-format fsdp_dtensor --data-cache-path ${DATA_CACHE_PATH} --bf16 --async-save "
        "--use-persistent-ckpt-worker "
    ),
    "gpt3_mcore_te_tp2_pp1_fsdp2_resume_torch_dist": (
        "--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad "
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir ${TENSORBOARD_PATH} "
        "--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 "
        "--train-iters 100 --timing-log-level 0 --lr-decay-iters 320000 --save ${CHECKPOINT_SAVE_PATH} --load "
        "${CHECKPOINT_LOAD_PATH} --data-path "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document --vocab-file "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json --merge-file "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt --split 949,50,1 --distributed-backend "
        "nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 "
        "--lr-warmup-fraction 0.01 --log-interval 1 --save-interval 50 --eval-interval 1000 --eval-iters 10 "
        "--transformer-impl transformer_engine --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
        "--use-torch-fsdp2 --untie-embeddings-and-output-weights --deterministic-mode "
        "--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-checkpoint-opt_param-scheduler "
        "--use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all --data-cache-path "
        "${DATA_CACHE_PATH} --bf16 --log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker "
    ),
    "gpt3_mcore_tp1_pp1_fsdp2_resume_torch_dist_te": (
        "--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad "
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir ${TENSORBOARD_PATH} "
        "--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 "
        "--train-iters 100 --timing-log-level 0 --lr-decay-iters 320000 --save ${CHECKPOINT_SAVE_PATH} --load "
        "${CHECKPOINT_LOAD_PATH} --data-path "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document --vocab-file "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json --merge-file "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt --split 949,50,1 --distributed-backend "
        "nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 "
        "--lr-warmup-fraction 0.01 --log-interval 1 --save-interval 50 --eval-interval 1000 --eval-iters 10 "
        "--transformer-impl transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
        "--use-torch-fsdp2 --deterministic-mode --no-gradient-accumulation-fusion "
        "--use-checkpoint-opt_param-scheduler --use-mcore-models --ckpt-format torch_dist "
        "--dist-ckpt-optim-fully-reshardable --dist-ckpt-strictness log_all --data-cache-path ${DATA_CACHE_PATH} "
        "--fp16 --apply-query-key-layer-scaling --log-memory-to-tensorboard --async-save "
        "--use-persistent-ckpt-worker "
    ),
    "gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router": (
        "--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad "
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --log-memory-to-tensorboard "
        "--tensorboard-dir ${TENSORBOARD_PATH} --micro-batch-size 4 --global-batch-size 32 --seq-length 1024 "
        "--max-position-embeddings 1024 --train-iters 100 --timing-log-level 0 --lr-decay-iters 320000 --save "
        "${CHECKPOINT_SAVE_PATH} --load ${CHECKPOINT_LOAD_PATH} --data-path "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document --vocab-file "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json --merge-file "
        "${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt --split 949,50,1 --distributed-backend "
        "nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 "
        "--lr-warmup-fraction 0.01 --log-interval 1 --save-interval 50 --eval-interval 1000 --eval-iters 10 "
        "--transformer-impl transformer_engine --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
        "--expert-model-parallel-size 2 --disable-bias-linear --sequence-parallel --num-experts 8 "
        "--moe-router-load-balancing-type aux_loss --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
        "--use-megatron-fsdp --calculate-per-token-loss --data-parallel-sharding-strategy optim_grads_params "
        "--use-distributed-optimizer --deterministic-mode --no-gradient-accumulation-fusion --moe-grouped-gemm "
        "--attention-softmax-in-fp32 --use-checkpoint-opt_param-scheduler --use-mcore-models --ckpt-format "
        "fsdp_dtensor --dist-ckpt-optim-fully-reshardable --dist-ckpt-strictness log_all --data-cache-path "
        "${DATA_CACHE_PATH} --bf16 --no-bias-gelu-fusion "
    ),
    "deepseek_proxy_fsdp_ep2_fsdp2": (
        "--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
        "--expert-model-parallel-size 2 --context-parallel-size 1 --expert-tensor-parallel-size 1 "
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --attention-backend unfused "
        "--num-distributed-optimizer-instances 1 --use-megatron-fsdp --data-parallel-sharding-strategy "
        "optim_grads_params --outer-dp-sharding-strategy no_shard --deterministic-mode --ckpt-format fsdp_dtensor "
        "--no-gradient-accumulation-fusion --fp8-format e4m3 --fp8-recipe tensorwise --fp8-param-gather "
        "--use-mcore-models --sequence-parallel --disable-bias-linear --micro-batch-size 32 --global-batch-size "
        "256 --train-iters 50 --exit-duration-in-mins 60 --no-check-for-nan-in-loss-and-grad --no-rope-fusion "
        "--manual-gc --manual-gc-interval 100 --transformer-impl transformer_engine --seq-length 1024 "
        "--data-cache-path ${DATA_CACHE_PATH} --data-path "
        "${DATA_PATH}/text/the_pile/shard00/my-gpt3_00_text_document --vocab-file "
        "${DATA_PATH}/text/the_pile/shard00/bpe/vocab.json --merge-file "
        "${DATA_PATH}/text/the_pile/shard00/bpe/merges.txt --split 949,50,1 --num-layers 8 --hidden-size 512 "
        "--ffn-hidden-size 2048 --num-attention-heads 8 --kv-channels 128 --max-position-embeddings 1024 "
        "--position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 64 --normalization "
        "RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention "
        "--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm "
        "--lr-warmup-fraction 0.01 --lr 0.00015 --min-lr 1e-05 --lr-decay-style cosine --adam-beta1 0.9 "
        "--adam-beta2 0.95 --num-experts 8 --moe-layer-freq ([0]*3+[1]*5) --moe-ffn-hidden-size 1024 "
        "--moe-shared-expert-intermediate-size 1024 --moe-router-load-balancing-type seq_aux_loss "
        "--moe-router-topk 4 --moe-token-dispatcher-type alltoall --moe-router-pre-softmax --moe-grouped-gemm "
        "--moe-aux-loss-coeff 1e-4 --moe-router-group-topk 2 --moe-router-num-groups 4 "
        "--moe-router-topk-scaling-factor 2.0 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion --q-lora-rank 256 "
        "--kv-lora-rank 128 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor "
        "1.0 --mscale 1.0 --mscale-all-dim 1.0 --eval-iters 10 --eval-interval 200 --save-interval 25 "
        "--init-method-std 0.02 --log-timers-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad "
        "--log-params-norm --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level "
        "10 --tensorboard-dir ${TENSORBOARD_PATH} --exit-interval 50 "
    ),
    "deepseek_proxy_fsdp_ep2_fsdp2_1node": (
        "--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
        "--expert-model-parallel-size 2 --context-parallel-size 1 --expert-tensor-parallel-size 1 "
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --attention-backend unfused "
        "--num-distributed-optimizer-instances 1 --use-megatron-fsdp --data-parallel-sharding-strategy "
        "optim_grads_params --outer-dp-sharding-strategy no_shard --deterministic-mode --ckpt-format fsdp_dtensor "
        "--no-gradient-accumulation-fusion --fp8-format e4m3 --fp8-recipe tensorwise --fp8-param-gather "
        "--use-mcore-models --sequence-parallel --disable-bias-linear --micro-batch-size 4 --global-batch-size 32 "
        "--train-iters 50 --exit-duration-in-mins 60 --no-check-for-nan-in-loss-and-grad --no-rope-fusion "
        "--manual-gc --manual-gc-interval 100 --transformer-impl transformer_engine --seq-length 1024 "
        "--data-cache-path ${DATA_CACHE_PATH} --data-path "
        "${DATA_PATH}/text/the_pile/shard00/my-gpt3_00_text_document --vocab-file "
        "${DATA_PATH}/text/the_pile/shard00/bpe/vocab.json --merge-file "
        "${DATA_PATH}/text/the_pile/shard00/bpe/merges.txt --split 949,50,1 --num-layers 2 --hidden-size 512 "
        "--ffn-hidden-size 2048 --num-attention-heads 8 --kv-channels 128 --max-position-embeddings 1024 "
        "--position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 64 --normalization "
        "RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention "
        "--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm "
        "--lr-warmup-fraction 0.01 --lr 0.00015 --min-lr 1e-05 --lr-decay-style cosine --adam-beta1 0.9 "
        "--adam-beta2 0.95 --num-experts 8 --moe-layer-freq ([0]*1+[1]*1) --moe-ffn-hidden-size 1024 "
        "--moe-shared-expert-intermediate-size 1024 --moe-router-load-balancing-type seq_aux_loss "
        "--moe-router-topk 4 --moe-token-dispatcher-type alltoall --moe-router-pre-softmax --moe-grouped-gemm "
        "--moe-aux-loss-coeff 1e-4 --moe-router-group-topk 2 --moe-router-num-groups 4 "
        "--moe-router-topk-scaling-factor 2.0 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion --q-lora-rank 256 "
        "--kv-lora-rank 128 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor "
        "1.0 --mscale 1.0 --mscale-all-dim 1.0 --eval-iters 10 --eval-interval 200 --save-interval 25 "
        "--init-method-std 0.02 --log-timers-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad "
        "--log-params-norm --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level "
        "10 --tensorboard-dir ${TENSORBOARD_PATH} --exit-interval 50 "
    ),
    "deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap": (
        "--bf16 --overlap-moe-expert-parallel-comm --delay-wgrad-compute --distributed-timeout-minutes 60 "
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 2 "
        "--context-parallel-size 1 --expert-tensor-parallel-size 1 --use-distributed-optimizer "
        "--overlap-grad-reduce --overlap-param-gather --attention-backend unfused "
        "--num-distributed-optimizer-instances 1 --use-megatron-fsdp --data-parallel-sharding-strategy "
        "optim_grads_params --outer-dp-sharding-strategy no_shard --deterministic-mode --ckpt-format fsdp_dtensor "
        "--no-gradient-accumulation-fusion --megatron-fsdp-main-params-dtype fp32 "
        "--megatron-fsdp-main-grads-dtype fp32 --megatron-fsdp-grad-comm-dtype fp32 --use-mcore-models "
        "--sequence-parallel --disable-bias-linear --micro-batch-size 4 --global-batch-size 32 --train-iters 50 "
        "--exit-duration-in-mins 60 --no-check-for-nan-in-loss-and-grad --no-rope-fusion --manual-gc "
        "--manual-gc-interval 100 --transformer-impl transformer_engine --seq-length 1024 --data-cache-path "
        "${DATA_CACHE_PATH} --data-path ${DATA_PATH}/text/the_pile/shard00/my-gpt3_00_text_document --vocab-file "
        "${DATA_PATH}/text/the_pile/shard00/bpe/vocab.json --merge-file "
        "${DATA_PATH}/text/the_pile/shard00/bpe/merges.txt --split 949,50,1 --num-layers 2 --hidden-size 512 "
        "--ffn-hidden-size 2048 --num-attention-heads 8 --kv-channels 128 --max-position-embeddings 1024 "
        "--position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 64 --normalization "
        "RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention "
        "--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm "
        "--lr-warmup-fraction 0.01 --lr 0.00015 --min-lr 1e-05 --lr-decay-style cosine --adam-beta1 0.9 "
        "--adam-beta2 0.95 --num-experts 8 --moe-layer-freq ([0]*1+[1]*1) --moe-ffn-hidden-size 1024 "
        "--moe-shared-expert-intermediate-size 1024 --moe-router-load-balancing-type seq_aux_loss "
        "--moe-router-topk 4 --moe-token-dispatcher-type alltoall --moe-router-pre-softmax --moe-grouped-gemm "
        "--moe-aux-loss-coeff 1e-4 --moe-router-group-topk 2 --moe-router-num-groups 4 "
        "--moe-router-topk-scaling-factor 2.0 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion --q-lora-rank 256 "
        "--kv-lora-rank 128 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor "
        "1.0 --mscale 1.0 --mscale-all-dim 1.0 --eval-iters 10 --eval-interval 200 --save-interval 25 "
        "--init-method-std 0.02 --log-timers-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad "
        "--log-params-norm --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level "
        "10 --tensorboard-dir ${TENSORBOARD_PATH} --exit-interval 50 "
    ),}

# Sizes, lengths and intervals: a 2-layer model of width 32 trained for 16 iterations (mock data, 60 tokens).
SCALED: dict[str, str] = {
    "--num-layers": "2", "--hidden-size": "32", "--num-attention-heads": "4", "--ffn-hidden-size": "64",
    "--kv-channels": "8", "--seq-length": "32", "--max-position-embeddings": "32", "--micro-batch-size": "2",
    "--global-batch-size": "8", "--train-iters": "16", "--lr": "3e-3", "--lr-decay-iters": "16",
    "--eval-interval": "4", "--eval-iters": "1", "--save-interval": "4", "--log-interval": "4",
    "--exit-interval": "16", "--num-experts": "4", "--moe-router-topk": "2", "--moe-ffn-hidden-size": "32",
    "--moe-layer-freq": "([0]*1+[1]*1)", "--make-vocab-size-divisible-by": "16", "--split": "969,30,1",
    "--moe-shared-expert-intermediate-size": "32",
    # multi-latent attention's ranks and head sizes (the query/key head 8 + 4, the value head 8)
    "--q-lora-rank": "16", "--kv-lora-rank": "8", "--qk-head-dim": "8", "--qk-pos-emb-head-dim": "4",
    "--v-head-dim": "8",
}
# GPU-only flags: flag -> its CPU replacement ("" drops it), and why.
REPLACED: dict[str, tuple[str, str]] = {
    "--distributed-backend": ("--distributed-backend gloo", "no NCCL on CPU"),
    "--transformer-impl": ("--transformer-impl local", "no TransformerEngine on CPU"),
    "--data-path": ("--mock-data --vocab-size 60", "Megatron's corpus is not available; mock data"),
    "--vocab-file": ("", "GPT-2 BPE files: mock data needs no tokenizer files"),
    "--merge-file": ("", "as --vocab-file"),
    "--fp16": ("--bf16", "fp16 (loss scaling) is not supported here; bf16 is the reduced precision"),
    "--fp8-format": ("", "FP8 needs TransformerEngine on CUDA"),
    "--fp8-recipe": ("", "as --fp8-format"),
    "--fp8-param-gather": ("", "as --fp8-format"),
    "--overlap-moe-expert-parallel-comm": ("", "needs CUDA streams and pipeline scheduling"),
    "--delay-wgrad-compute": ("", "needs TransformerEngine"),
}


def _pieces(command: str) -> list[list[str]]:
    """``--flag [values...]`` groups of a command line."""
    out: list[list[str]] = []
    for token in command.split():
        if token.startswith("--"):
            out.append([token])
        else:
            out[-1].append(token)
    return out


def megatron_argv(name: str) -> list[str]:
    """The configuration's command line as Megatron-LM runs it (placeholders as they are)."""
    return MEGATRON_LM[name].split()


def cpu_scaled(name: str, ckpt: str) -> list[str]:
    """The configuration scaled to CPU: ``ckpt`` holds its --save/--load, tensorboard and cache directories.

    Every model flag is kept (megatron-core's GPTModel implements multi-latent attention, shared experts,
    the router options, --calculate-per-token-loss; its MoELayer runs under TP with --sequence-parallel, at
    Megatron's default expert TP size: the TP size).
    """
    argv: list[str] = ["--model-provider", "mcore"]
    for flag, *values in _pieces(MEGATRON_LM[name]):
        if flag in REPLACED:
            argv += REPLACED[flag][0].split()
        elif flag in SCALED:
            argv += [flag, SCALED[flag]]
        elif flag in ("--save", "--load"):
            argv += [flag, ckpt]
        elif flag in ("--tensorboard-dir", "--data-cache-path"):
            argv += [flag, f"{ckpt}-{flag[2:]}"]
        else:
            argv += [flag, *values]
    # Megatron's resume tests --load an empty directory on their first run: fresh start, which needs ours.
    if "--load" in argv:
        argv.append("--allow-fresh-start")
    return argv + ["--seed", "42"]
