# Sourced by the example scripts (gpt2_125m.sh, ..., llama_13b_4x8.sh): `launch ARGS...`
# runs pretrain_gpt.py ARGS under torchrun on this node, one process per GPU, or, with
# DRY_RUN=1, validates ARGS and prints their per-GPU memory plan instead
# (tools/estimate_memory.py, for a world of GPUS_PER_NODE x NNODES GPUs) and exits.
#
# Multi-node: run the same script on every node with NNODES, NODE_RANK (0..NNODES-1) and
# MASTER_ADDR (node 0's address) set; MASTER_PORT defaults to 6000.
# Data: DATA_PATH (indexed dataset prefixes, optionally weighted: "0.3 a 0.7 b") and the
# tokenizer files each script names; without DATA_PATH the run uses mock data with the
# model's vocabulary (a smoke test of the layout, not a training run).
# Checkpoints go to CHECKPOINT_DIR (resumed from when restarted); TensorBoard to
# TENSORBOARD_DIR; EXTRA_ARGS is appended as is (e.g. EXTRA_ARGS="--train-iters 100").

PYTHON=${PYTHON:-python3}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

launch() {
    local extra=()
    read -r -a extra <<<"${EXTRA_ARGS:-}" || true
    if [ "${DRY_RUN:-0}" = 1 ]; then
        exec "$PYTHON" tools/estimate_memory.py --world-size "$WORLD_SIZE" \
            --gpu-memory-gib "${GPU_MEMORY_GIB:-80}" "$@" "${extra[@]}"
    fi
    exec torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" \
        --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
        pretrain_gpt.py "$@" "${extra[@]}"
}

# The flags shared by every example: checkpoints (saved every SAVE_INTERVAL iterations
# and on SIGTERM/SIGUSR1, resumed from on restart), logging and evaluation.
common_args() {
    local name=$1
    local checkpoints=${CHECKPOINT_DIR:-checkpoints/$name}
    COMMON_ARGS=(--save "$checkpoints" --load "$checkpoints"
                 --save-interval "${SAVE_INTERVAL:-1000}" --keep-last-n-checkpoints 3
                 --exit-signal-handler
                 --log-interval 10 --log-throughput --eval-interval 1000 --eval-iters 10
                 --tensorboard-dir "${TENSORBOARD_DIR:-runs/$name}")
}

# DATA_ARGS: the DATA_PATH prefixes split 969/30/1, or mock data with the tokenizer's
# vocabulary when DATA_PATH is unset.
gpt2_data_args() {  # GPT-2 BPE: VOCAB_FILE and MERGE_FILE
    if [ -z "${DATA_PATH:-}" ]; then
        DATA_ARGS=(--mock-data --vocab-size 50257)
        return
    fi
    read -r -a DATA_PREFIXES <<<"$DATA_PATH"
    DATA_ARGS=(--data-path "${DATA_PREFIXES[@]}" --split 969,30,1
               --tokenizer-type GPT2BPETokenizer
               --vocab-file "${VOCAB_FILE:?set VOCAB_FILE to the GPT-2 vocab.json}"
               --merge-file "${MERGE_FILE:?set MERGE_FILE to the GPT-2 merges.txt}")
}

sentencepiece_data_args() {  # a 32000-piece SentencePiece model: TOKENIZER_MODEL
    if [ -z "${DATA_PATH:-}" ]; then
        DATA_ARGS=(--mock-data --vocab-size 32000)
        return
    fi
    read -r -a DATA_PREFIXES <<<"$DATA_PATH"
    DATA_ARGS=(--data-path "${DATA_PREFIXES[@]}" --split 969,30,1
               --tokenizer-type SentencePieceTokenizer
               --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL (32000 pieces)}")
}
