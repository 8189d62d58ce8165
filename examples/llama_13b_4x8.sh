#!/usr/bin/env bash
# Llama-style 13B pretrained from scratch on 4 nodes x 8 GPUs.
# The model, layout, batch, optimizer and planned memory per GPU: examples/configs/llama_13b_4x8.yaml.
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

sentencepiece_data_args
common_args llama_13b
launch --yaml-cfg examples/configs/llama_13b_4x8.yaml "${DATA_ARGS[@]}" "${COMMON_ARGS[@]}"
