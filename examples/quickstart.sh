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

"$PYTHON" pretrain_gpt.py --yaml-cfg examples/configs/quickstart.yaml \
    --data-path "$DATA/stdlib_text_document" --split 98,2,0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tokenizer.model" \
    --train-iters "$TRAIN_ITERS"

# What the model writes: a sample from the checkpoint just saved (KV-cached decoding).
"$PYTHON" tools/generate.py --yaml-cfg examples/configs/quickstart.yaml \
    --load runs/quickstart/checkpoints \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tokenizer.model" \
    --prompt "def " --max-new-tokens 96 --top-k 40 --temperature 0.8 --seed 1
