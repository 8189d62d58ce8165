#!/usr/bin/env bash
# Llama-style 7B (the Mistral-7B shape: 32 layers, hidden 4096, 32 heads in 8 query groups
# (GQA), SwiGLU MLP 14336, RoPE, RMSNorm, no biases, untied output layer, vocabulary
# 32000; 7.24B parameters), pretrained from scratch on one node.
#
# Layout: 8 GPUs = TP 2 (with sequence parallelism) x PP 1 x DP 4, ZeRO-1, bf16.
#   Why: DP 8 alone (TP 1, ZeRO-1) plans 81 GiB per GPU (102% of 80 GiB: 13 GiB of bf16
#   weights, 27 GiB of fp32 gradients (bf16 accumulates in fp32, as in Megatron), 31 GiB
#   of activations): it does not fit. TP 2 + SP halves the weights,
#   gradients and activations, and stays inside the node's NVLink; ZeRO-1 divides the
#   12 bytes/parameter of optimizer state by DP 4. (Alternatives: docs/benchmarks.md.)
# Global batch: 1024 sequences x 4096 tokens = 4.2M tokens per step (micro-batch 1,
#   256 micro-batches per GPU per step); 35k steps = 147B tokens (20 tokens per parameter).
# Expected memory per GPU (tools/estimate_memory.py, cuda, 80 GiB): 46.07 GiB total (58%)
#   params 6.74 | grads 13.49 | optimizer 10.12 | fp32 main grads 0.00 | activations 15.72
#
#   DATA_PATH=data/my_text_document TOKENIZER_MODEL=llama/tokenizer.model \
#       bash examples/llama_7b.sh
#   DRY_RUN=1 bash examples/llama_7b.sh       # check the flags, print the memory plan
# Environment hooks (NNODES, NODE_RANK, MASTER_ADDR, CHECKPOINT_DIR, ...): examples/launch.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/launch.sh

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32
            --group-query-attention --num-query-groups 8 --ffn-hidden-size 14336
            --seq-length 4096 --max-position-embeddings 4096
            --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm
            --norm-epsilon 1e-5 --swiglu --disable-bias-linear
            --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --sequence-parallel
               --pipeline-model-parallel-size 1
               --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 1024 --train-iters 35000
               --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
               --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5
               --clip-grad 1.0 --bf16)
sentencepiece_data_args
common_args llama_7b
launch "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${COMMON_ARGS[@]}"
