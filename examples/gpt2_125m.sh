#!/usr/bin/env bash
# GPT-2 125M pretrained from scratch on one node of 8 GPUs.
# The model, layout, batch, optimizer and planned memory per GPU: examples/configs/gpt2_125m.yaml.
#
#   DATA_PATH=data/owt_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt \
#       bash examples/gpt2_125m.sh
#   DRY_RUN=1 bash examples/gpt2_125m.sh      # check the flags, print the memory plan
# Environment hooks (NNODES, NODE_RANK, MASTER_ADDR, CHECKPOINT_DIR, ...): examples/launch.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/launch.sh

gpt2_data_args
common_args gpt2_125m
launch --yaml-cfg examples/configs/gpt2_125m.yaml "${DATA_ARGS[@]}" "${COMMON_ARGS[@]}"
