#!/usr/bin/env bash
# Llama-style 13B (the Llama-2-13B shape: 40 layers, hidden 5120, 40 heads, SwiGLU MLP
# 13824, RoPE, RMSNorm, no biases, untied output layer, vocabulary 32000; 13.0B
# parameters), pretrained from scratch on 4 nodes x 8 GPUs (80 GB each).
#
# Layout: 32 GPUs = TP 4 (with sequence parallelism) x PP 1 x DP 8, ZeRO-1, bf16.
#   Why: with DP alone (TP 1, ZeRO-1) a GPU holds 13B x (2 + 4) bytes of bf16 weights and
#   fp32 gradients (bf16 accumulates in fp32, as in Megatron) plus 46 GiB of activations:
#   about 120 GiB, it does not fit; TP 2 + SP plans 66 GiB (83%), too close to the limit
#   once transients and fragmentation come in. TP 4 + SP quarters the weights, gradients
#   and activations: the least model parallelism that fits without recomputing layers,
#   TP inside a node, no pipeline bubble. ZeRO-1 over DP 8 brings the optimizer state
#   from 36 GiB (12 bytes x 3.3B) to 4.6 GiB. (Alternatives, each planned:
#   docs/benchmarks.md.)
# Global batch: 1024 sequences x 4096 tokens = 4.2M tokens per step (micro-batch 1,
#   128 micro-batches per GPU per step); 65k steps = 273B tokens (20 tokens per parameter).
# Expected memory per GPU (tools/estimate_memory.py, cuda, 80 GiB): 36.15 GiB total (45%)
#   params 6.06 | grads 12.13 | optimizer 4.55 | fp32 main grads 0.00 | activations 13.41
#
#   On each node i of 4 (NODE_RANK=i, MASTER_ADDR=node 0's address):
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=node0 DATA_PATH=data/my_text_document \
#       TOKENIZER_MODEL=llama/tokenizer.model bash examples/llama_13b_4x8.sh
#   DRY_RUN=1 NNODES=4 bash examples/llama_13b_4x8.sh   # check the flags, print the plan
#   (Slurm: examples/slurm/train_gpt.sbatch starts one torchrun per node the same way.)
# Environment hooks (NNODES, NODE_RANK, MASTER_ADDR, CHECKPOINT_DIR, ...): examples/launch.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-4}
source examples/launch.sh

MODEL_ARGS=(--num-layers 40 --hidden-size 5120 --num-attention-heads 40
            --ffn-hidden-size 13824 --seq-length 4096 --max-position-embeddings 4096
            --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm
            --norm-epsilon 1e-5 --swiglu --disable-bias-linear
            --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0)
PARALLEL_ARGS=(--tensor-model-parallel-size 4 --sequence-parallel
               --pipeline-model-parallel-size 1
               --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 1024 --train-iters 65000
               --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
               --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5
               --clip-grad 1.0 --bf16)
sentencepiece_data_args
common_args llama_13b
launch "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${COMMON_ARGS[@]}"
