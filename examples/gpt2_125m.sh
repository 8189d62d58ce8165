#!/usr/bin/env bash
# GPT-2 125M (GPT-2 small: 12 layers, hidden 768, 12 heads, learned positions, LayerNorm,
# GeLU, tied embeddings, vocabulary 50257), pretrained from scratch on one node.
#
# Layout: 8 GPUs = TP 1 x PP 1 x DP 8, ZeRO-1 (--use-distributed-optimizer), bf16.
# Global batch: 512 sequences x 1024 tokens = 0.5M tokens per step (micro-batch 16,
#   4 micro-batches per GPU per step); 600k steps = 300B tokens (nanoGPT's recipe).
# Expected memory per GPU (tools/estimate_memory.py, cuda, 80 GiB): 9.66 GiB total (12%)
#   params 0.23 | grads 0.46 | optimizer 0.17 | fp32 main grads 0.00 | activations 8.79
#   (the fp32 softmax of the loss, [1024, 16, 50304], is 3.1 GiB of the activations)
#
#   DATA_PATH=data/owt_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt \
#       bash examples/gpt2_125m.sh
#   DRY_RUN=1 bash examples/gpt2_125m.sh      # check the flags, print the memory plan
# Environment hooks (NNODES, NODE_RANK, MASTER_ADDR, CHECKPOINT_DIR, ...): examples/launch.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/launch.sh

MODEL_ARGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12
            --seq-length 1024 --max-position-embeddings 1024)
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
               --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
TRAINING_ARGS=(--micro-batch-size 16 --global-batch-size 512 --train-iters 600000
               --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 2000
               --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16)
gpt2_data_args
common_args gpt2_125m
launch "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${COMMON_ARGS[@]}"
