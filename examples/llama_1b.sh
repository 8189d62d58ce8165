#!/usr/bin/env bash
# Llama-style 1B pretrained from scratch on one node of 8 GPUs.
# The model, layout, batch, optimizer and planned memory per GPU: examples/configs/llama_1b.yaml.
#
#   DATA_PATH=data/my_text_document TOKENIZER_MODEL=llama/tokenizer.model \
#       bash examples/llama_1b.sh
#   DRY_RUN=1 bash examples/llama_1b.sh       # check the flags, print the memory plan
# Environment hooks (NNODES, NODE_RANK, MASTER_ADDR, CHECKPOINT_DIR, ...): examples/launch.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/launch.sh

sentencepiece_data_args
common_args llama_1b
launch --yaml-cfg examples/configs/llama_1b.yaml "${DATA_ARGS[@]}" "${COMMON_ARGS[@]}"
