#!/usr/bin/env bash
# Llama-style 1.1B (the TinyLlama-1.1B shape: 22 layers, hidden 2048, 32 heads in 4 query
# groups (GQA), SwiGLU MLP 5632, RoPE, RMSNorm, no biases, untied output layer,
# vocabulary 32000), pretrained from scratch on one node.
#
# Layout: 8 GPUs = TP 1 x PP 1 x DP 8, ZeRO-1 (--use-distributed-optimizer), bf16.
# Global batch: 1024 sequences x 2048 tokens = 2.1M tokens per step (micro-batch 8,
#   16 micro-batches per GPU per step); 10.5k steps = 22B tokens (20 tokens per parameter).
# Expected memory per GPU (tools/estimate_memory.py, cuda, 80 GiB): 44.89 GiB total (56%)
#   params 2.05 | grads 4.10 | optimizer 1.54 | fp32 main grads 0.00 | activations 37.20
#
#   DATA_PATH=data/my_text_document TOKENIZER_MODEL=llama/tokenizer.model \
#       bash examples/llama_1b.sh
#   DRY_RUN=1 bash examples/llama_1b.sh       # check the flags, print the memory plan
# Environment hooks (NNODES, NODE_RANK, MASTER_ADDR, CHECKPOINT_DIR, ...): examples/launch.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/launch.sh

MODEL_ARGS=(--num-layers 22 --hidden-size 2048 --num-attention-heads 32
            --group-query-attention --num-query-groups 4 --ffn-hidden-size 5632
            --seq-length 2048 --max-position-embeddings 2048
            --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm
            --norm-epsilon 1e-5 --swiglu --disable-bias-linear
            --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0)
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
               --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
TRAINING_ARGS=(--micro-batch-size 8 --global-batch-size 1024 --train-iters 10500
               --lr 4e-4 --min-lr 4e-5 --lr-decay-style cosine --lr-warmup-iters 2000
               --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5
               --clip-grad 1.0 --bf16)
sentencepiece_data_args
common_args llama_1b
launch "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${COMMON_ARGS[@]}"
