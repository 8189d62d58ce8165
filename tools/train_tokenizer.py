"""Train a SentencePiece BPE or unigram tokenizer from .txt, JSONL, Parquet or Arrow files.

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix data/tok \\
        --vocab-size 8000

writes `data/tok.model`, for `--tokenizer-type SentencePieceTokenizer --tokenizer-model
data/tok.model`. Ids: <unk> 0 (SentencePiece requires one), </s> 1, which
SentencePieceTokenizer uses as the end-of-document id; <s> and <pad> only with --bos/--pad.

A .txt file gives one training sentence per line; any other --input is read as
tools/preprocess_data.py reads it (JSONL, .gz, .zst, Parquet, Arrow, a directory or a glob
of them: megalite/data/document_sources.py) and gives each line of the text under --json-key (documents span many lines; SentencePiece trains on sentences, and
skips any longer than --max-sentence-length bytes). By default the text is kept as it is
(identity normalization, whitespace kept, byte fallback), so code and its indentation
round-trip exactly. The model is written to a temporary name, then renamed.
"""

import argparse
import glob
import gzip
import io
import json
import os
import sys

from megalite.atomic_write import atomic_write
from megalite.data.document_sources import check_dependencies, read_records, resolve_inputs
from megalite.errors import ConfigError, DataError, MegaliteError


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help=".txt files, or what preprocess_data.py --input takes "
                        "(JSONL, .gz, .zst, Parquet, Arrow; a directory or a glob)")
    parser.add_argument("--json-key", default="text", help="key of the text in .jsonl input")
    parser.add_argument("--model-prefix", required=True, help="writes {prefix}.model")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--character-coverage", type=float, default=1.0,
                        help="share of characters covered by pieces; the rest fall back")
    parser.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=True,
                        help="encode uncovered characters as UTF-8 byte pieces, not <unk>")
    parser.add_argument("--normalization", choices=("identity", "nfkc", "nmt_nfkc"),
                        default="identity", help="SentencePiece normalization rule")
    parser.add_argument("--remove-extra-whitespaces", action="store_true",
                        help="collapse runs of spaces (SentencePiece's default, bad for code)")
    parser.add_argument("--input-sentence-size", type=int, default=2_000_000,
                        help="sentences sampled for training (0: all)")
    parser.add_argument("--max-sentence-length", type=int, default=16384,
                        help="longer sentences (bytes) are skipped")
    parser.add_argument("--user-defined-symbols", nargs="*", default=[],
                        help="strings always kept as one piece")
    parser.add_argument("--bos", action="store_true", help="reserve <s> (id 2)")
    parser.add_argument("--pad", action="store_true", help="reserve <pad> (id 2, or 3 with --bos)")
    parser.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=1234, help="sentence sampling seed")
    args = parser.parse_args(argv)
    for path in args.input:
        if not (os.path.isfile(path) or os.path.isdir(path) or glob.glob(path)):
            raise DataError(f"--input {path}: file not found")
    if not os.path.isdir(os.path.dirname(args.model_prefix) or "."):
        raise DataError(f"--model-prefix {args.model_prefix}: directory not found")
    if args.vocab_size < 8:
        raise ConfigError(f"--vocab-size expected >= 8, got {args.vocab_size}")
    return args


def iter_sentences(paths, json_key):
    """Non-empty lines of every .txt file and of every document's text."""
    for path in paths:
        for text in _texts(path, json_key):
            for sentence in text.split("\n"):
                if sentence.strip():
                    yield sentence


def _texts(path, json_key):
    """A .txt file's lines; else each document of whatever preprocess_data.py reads (JSONL,
    .gz, .zst, Parquet, Arrow; a directory or a glob of them)."""
    if os.path.isfile(path) and path.removesuffix(".gz").endswith(".txt"):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            yield from f
        return
    sources = resolve_inputs(path)
    check_dependencies(sources)
    for source in sources:
        for row, _, payload in read_records(source, [json_key], 64):
            if isinstance(payload, bytes):  # a JSONL line
                payload = payload.decode("utf-8", errors="replace")
                yield _document_text(source.where(row), payload, json_key)
            else:
                yield _column_text(source.where(row), payload[json_key], json_key)


def _column_text(where, text, json_key):
    if not isinstance(text, str):
        raise DataError(f"{where}: {json_key!r} holds {type(text).__name__}, expected a string")
    return text


def _document_text(where, line, json_key):
    try:
        text = json.loads(line)[json_key]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{where}: no string under {json_key!r} ({e!r})") from None
    return _column_text(where, text, json_key)


def train(args):
    import sentencepiece as spm

    spm.set_random_generator_seed(args.seed)
    model, errors = io.BytesIO(), []
    try:
        _train(spm, args, _recording(iter_sentences(args.input, args.json_key), errors), model)
    except RuntimeError:
        if errors:  # SentencePiece wraps what the iterator raised: show it plainly
            raise errors[0] from None
        raise
    path = args.model_prefix + ".model"
    atomic_write(path, lambda f: f.write(model.getvalue()))
    return path


def _recording(sentences, errors):
    try:
        yield from sentences
    except DataError as e:
        errors.append(e)
        raise


def _train(spm, args, sentences, model):
    bos_id = 2 if args.bos else -1
    pad_id = (3 if args.bos else 2) if args.pad else -1
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences, model_writer=model,
        vocab_size=args.vocab_size, model_type=args.model_type,
        character_coverage=args.character_coverage, byte_fallback=args.byte_fallback,
        normalization_rule_name=args.normalization,
        remove_extra_whitespaces=args.remove_extra_whitespaces,
        allow_whitespace_only_pieces=True, split_digits=True,
        input_sentence_size=args.input_sentence_size, shuffle_input_sentence=True,
        max_sentence_length=args.max_sentence_length,
        user_defined_symbols=args.user_defined_symbols,
        unk_id=0, eos_id=1, bos_id=bos_id, pad_id=pad_id,
        num_threads=args.num_threads, minloglevel=1)


def main(argv=None):
    try:
        args = get_args(argv)
        path = train(args)
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # how SentencePiece reports bad settings, e.g. a vocab too big
        print(f"error: sentencepiece: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} (vocab {args.vocab_size}, {args.model_type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
