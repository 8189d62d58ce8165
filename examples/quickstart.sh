#!/usr/bin/env bash
# The quick start: install, build the embedded corpus (the Python standard library's own
# source), train a SentencePiece tokenizer on it, preprocess it to Megatron's .bin/.idx
# format, pretrain a small GPT on it on this machine (CPU/gloo, or a GPU if present), save
# a checkpoint, and print a sample of what it writes.
#
#   bash examples/quickstart.sh            # everything lands in data/stdlib and runs/
#   TRAIN_ITERS=1000 bash examples/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DATA=${DATA:-data/stdlib}
TRAIN_ITERS=${TRAIN_ITERS:-200}

bash install.sh
mkdir -p "$DATA"
[ -f "$DATA/corpus.jsonl" ] || "$PYTHON" tools/build_stdlib_corpus.py --output "$DATA/corpus.jsonl"
[ -f "$DATA/tokenizer.model" ] || "$PYTHON" tools/train_tokenizer.py \
    --input "$DATA/corpus.jsonl" --model-prefix "$DATA/tokenizer" --vocab-size 4096
[ -f "$DATA/stdlib_text_document.idx" ] || "$PYTHON" tools/preprocess_data.py \
    --input "$DATA/corpus.jsonl" --output-prefix "$DATA/stdlib" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tokenizer.model" \
    --append-eod --workers 2
# A context-free model cannot beat the unigram entropy; the validation loss below should.
"$PYTHON" tools/dataset_stats.py --data-path "$DATA/stdlib_text_document"

"$PYTHON" pretrain_gpt.py \
    --data-path "$DATA/stdlib_text_document" --split 98,2,0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tokenizer.model" \
    --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --attention-dropout 0 --hidden-dropout 0 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters "$TRAIN_ITERS" \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
    --log-interval 20 --log-throughput --eval-interval 100 --eval-iters 10 \
    --tensorboard-dir runs/quickstart --save runs/quickstart/checkpoints

# What the model writes: a sample from the checkpoint just saved (KV-cached decoding).
"$PYTHON" tools/generate.py --load runs/quickstart/checkpoints \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tokenizer.model" \
    --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --prompt "def " --max-new-tokens 96 --top-k 40 --temperature 0.8 --seed 1
