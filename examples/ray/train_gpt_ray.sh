#!/usr/bin/env bash
# GPT-2 125M on a Ray cluster: one rank per GPU as a Ray actor, the group restarted from
# the newest checkpoint when a worker or a node is lost (tools/ray_launch.py). Run it from
# any node of the cluster (`ray.init` finds it through RAY_ADDRESS, default auto):
#
#   bash examples/ray/train_gpt_ray.sh                               # 16 ranks, mock data
#   NUM_WORKERS=32 CHECKPOINT_DIR=/shared/gpt2 DATA_PATH=... VOCAB_FILE=... MERGE_FILE=... \
#       bash examples/ray/train_gpt_ray.sh
#
# CHECKPOINT_DIR must be storage every node sees (NFS, a shared volume): a restarted group
# may land on other nodes, and resumes from it. The data, checkpoint and logging flags are
# examples/launch.sh's, as for the torchrun examples.
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/launch.sh

gpt2_data_args
common_args gpt2_125m
NOTICE_SECONDS=${NOTICE_SECONDS:-120}  # the spot warning: 120 s on AWS, 30 s on GCP, Azure
exec "$PYTHON" tools/ray_launch.py --address "${RAY_ADDRESS:-auto}" \
    --num-workers "${NUM_WORKERS:-16}" --gpus-per-worker 1 --cpus-per-worker 8 \
    --max-failures "${MAX_FAILURES:-10}" -- \
    --yaml-cfg examples/configs/gpt2_125m.yaml "${DATA_ARGS[@]}" "${COMMON_ARGS[@]}" \
    --preemption-notice-seconds "$NOTICE_SECONDS" "$@"
