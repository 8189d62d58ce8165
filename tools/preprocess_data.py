"""Tokenize a JSONL corpus into Megatron's indexed-dataset format (.bin/.idx, docs/design.md §7).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \\
        --append-eod --workers 2

writes `data/corpus_text_document.bin/.idx`, one pair per `--json-keys` key, with the same
bytes Megatron-LM's tools/preprocess_data.py writes for the same input, tokenizer and flags.
Each line is a JSON object whose key holds a string (one sequence) or, as in Megatron, a
list of strings (one sequence each); `--input` may be gzipped (.gz).

Order: documents keep the input order whatever --workers and --partitions are.
--partitions N cuts the input into N contiguous line ranges encoded side by side and
concatenated (Megatron's --keep-sequential-samples order, so the bytes do not depend on N).

Memory is bounded whatever the input size: lines are read in chunks of CHUNK_LINES and at
most 2 x workers chunks are in flight per partition, so at most
(2 x workers + 1) x CHUNK_LINES documents (the raw line and its token ids) are held at once;
besides that only the index grows (4 bytes per sequence and 8 per document).

Bad input (malformed JSON, a missing key, invalid UTF-8, text that is not a string, a token
id outside the vocabulary) is reported as `file:line: reason`. --on-error fail (default)
stops there with exit 1 and leaves no output; --on-error skip drops the line and counts it.
An empty document gives no sequence but, as in Megatron, a document boundary; the summary
counts them. Outputs are written under temporary names and renamed at the end.
"""

import argparse
import collections
import dataclasses
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time

import numpy as np

from megalite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megalite.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from megalite.errors import ConfigError, DataError, MegaliteError

CHUNK_LINES = 64


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file, optionally gzipped (.gz)")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys whose text is tokenized, one output dataset per key")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", help="SentencePiece model or tokenizer.json")
    group.add_argument("--vocab-file", help="GPT2BPETokenizer vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size")
    group = parser.add_argument_group("tokenization process")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document id to every non-empty document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="writes {prefix}_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes in all")
    group.add_argument("--partitions", type=int, default=1,
                       help="input ranges encoded side by side (workers split among them)")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="print progress every this many documents")
    group.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                       help="on a bad input line: stop with exit 1, or skip it and count it")
    args = parser.parse_args(argv)
    _validate(args)
    return args


def _validate(args):
    for flag in ("workers", "partitions", "log_interval"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} expected >= 1, "
                              f"got {getattr(args, flag)}")
    if args.workers % args.partitions:
        raise ConfigError(f"--workers {args.workers} must be a multiple of "
                          f"--partitions {args.partitions}")
    if not os.path.isfile(args.input):
        raise DataError(f"--input {args.input}: file not found")
    out_dir = os.path.dirname(args.output_prefix) or "."
    if not os.path.isdir(out_dir):
        raise DataError(f"--output-prefix {args.output_prefix}: directory {out_dir} not found")


def tokenizer_kwargs(args):
    return dict(tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                merge_file=args.merge_file, vocab_size=args.vocab_size)


def output_prefix(prefix, key):
    return f"{prefix}_{key}_document"


# ---- worker side: one JSON line -> token ids per key, or the reason it is unusable ----

_worker = {}


def _init_worker(args):
    tokenizer = build_tokenizer(args.tokenizer_type, **tokenizer_kwargs(args))
    _worker.update(tokenizer=tokenizer, keys=args.json_keys,
                   eod=tokenizer.eod if args.append_eod else None)


class _BadLine(Exception):
    pass


def _encode_chunk(chunk):
    return [(lineno, len(line), _encode_line(line)) for lineno, line in chunk]


def _encode_line(line):
    """{key: (token ids, sequence lengths)}, or a str saying why the line is unusable."""
    try:
        data = _parse(line)
        return {key: _tokenize_document(_sentences(data, key)) for key in _worker["keys"]}
    except _BadLine as e:
        return str(e)


def _parse(line):
    try:
        text = line.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise _BadLine(f"invalid UTF-8 at byte {e.start}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _BadLine(f"malformed JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(data, dict):
        raise _BadLine(f"expected a JSON object, got {type(data).__name__}")
    return data


def _sentences(data, key):
    if key not in data:
        raise _BadLine(f"missing key {key!r}")
    value = data[key]
    sentences = value if isinstance(value, list) else [value]
    for sentence in sentences:
        if not isinstance(sentence, str):
            raise _BadLine(f"key {key!r}: expected a string or a list of strings, "
                           f"got {type(sentence).__name__}")
        try:  # a "\ud800" escape decodes to a lone surrogate no tokenizer can encode
            sentence.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _BadLine(f"key {key!r}: lone surrogate at character {e.start} "
                           "is not valid Unicode") from None
    return sentences


def _tokenize_document(sentences):
    """Megatron's Encoder.encode: one sequence per non-empty sentence, eod on the last."""
    tokenizer = _worker["tokenizer"]
    ids, lengths = [], []
    for sentence in sentences:
        try:
            sentence_ids = tokenizer.tokenize(sentence)
        except (DataError, ValueError) as e:
            raise _BadLine(f"cannot tokenize: {e}") from None
        if sentence_ids:
            ids.extend(sentence_ids)
            lengths.append(len(sentence_ids))
    if ids and _worker["eod"] is not None:
        ids.append(_worker["eod"])
        lengths[-1] += 1
    return _checked_ids(ids, tokenizer.vocab_size), lengths


def _checked_ids(ids, vocab_size):
    try:
        ids = np.array(ids, dtype=np.int64)
    except OverflowError:
        raise _BadLine("token id beyond int64") from None
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise _BadLine(f"token id {bad} outside the vocabulary [0, {vocab_size})")
    # In range, so int32 holds them exactly at half the bytes to send to the parent.
    return ids.astype(np.int32) if vocab_size <= 2**31 else ids


# ---- parent side: read lines, keep them in order, write the datasets ----

@dataclasses.dataclass
class Stats:
    lines: int = 0
    bytes: int = 0
    skipped: int = 0
    sequences: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    empty: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, other):
        self.lines += other.lines
        self.bytes += other.bytes
        self.skipped += other.skipped
        for field in ("sequences", "tokens", "empty"):
            getattr(self, field).update(getattr(other, field))


def _read_lines(path, start=0, stop=None):
    """(line number, bytes) for lines start+1 .. stop, 1-based; bytes so bad UTF-8 is ours."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        yield from itertools.islice(enumerate(f, start=1), start, stop)


def _chunks(items, size):
    items = iter(items)
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def _imap_bounded(pool, func, chunks, max_in_flight):
    """pool.imap, reading ahead at most `max_in_flight` chunks (imap reads all its input)."""
    pending = collections.deque()
    for chunk in chunks:
        pending.append(pool.apply_async(func, (chunk,)))
        if len(pending) >= max_in_flight:
            yield from pending.popleft().get()
    while pending:
        yield from pending.popleft().get()


class _Progress:
    def __init__(self, interval, label=""):
        self.interval, self.label, self.start = interval, label, time.time()

    def update(self, stats):
        if stats.lines % self.interval == 0:
            elapsed = max(time.time() - self.start, 1e-9)
            print(f"{self.label}Processed {stats.lines} documents "
                  f"({stats.lines / elapsed:.1f} docs/s, "
                  f"{stats.bytes / elapsed / 2**20:.2f} MB/s).", file=sys.stderr, flush=True)


def encode_lines(args, prefix, workers, start=0, stop=None, label=""):
    """Encode input lines start+1..stop into `{prefix}_{key}_document.*`; return Stats."""
    tokenizer = build_tokenizer(args.tokenizer_type, **tokenizer_kwargs(args))
    dtype, vocab = best_dtype(tokenizer.vocab_size), tokenizer.vocab_size
    stats, progress = Stats(), _Progress(args.log_interval, label)
    builders = {key: IndexedDatasetBuilder(output_prefix(prefix, key) + ".bin", dtype, vocab)
                for key in args.json_keys}
    try:
        with multiprocessing.Pool(workers, _init_worker, (args,)) as pool:
            chunks = _chunks(_read_lines(args.input, start, stop), CHUNK_LINES)
            for lineno, nbytes, doc in _imap_bounded(pool, _encode_chunk, chunks, 2 * workers):
                stats.lines, stats.bytes = stats.lines + 1, stats.bytes + nbytes
                if isinstance(doc, str):
                    _bad_line(args, lineno, doc, stats)
                else:
                    _add_document(builders, doc, stats)
                progress.update(stats)
        for key, builder in builders.items():
            builder.finalize(output_prefix(prefix, key) + ".idx")
    except BaseException:
        for builder in builders.values():
            builder.discard()
        raise
    return stats


def _bad_line(args, lineno, reason, stats):
    where = f"{args.input}:{lineno}: {reason}"
    if args.on_error == "fail":
        raise DataError(f"{where} (use --on-error skip to skip such lines)")
    print(f"{where} (skipped)", file=sys.stderr)
    stats.skipped += 1


def _add_document(builders, doc, stats):
    for key, (ids, lengths) in doc.items():
        builders[key].add_document(ids, lengths)
        stats.sequences[key] += len(lengths)
        stats.tokens[key] += ids.size
        stats.empty[key] += ids.size == 0


# ---- partitions: contiguous line ranges encoded by separate processes, then joined ----

def _count_lines(path):
    opener = gzip.open if path.endswith(".gz") else open
    count, last = 0, b"\n"
    with opener(path, "rb") as f:
        while block := f.read(1 << 24):
            count, last = count + block.count(b"\n"), block[-1:]
    return count + (last != b"\n")


def _encode_partition(args, index, start, stop, queue):
    try:
        stats = encode_lines(args, f"{args.output_prefix}_part{index}",
                             args.workers // args.partitions, start, stop,
                             label=f"[partition {index}] ")
        queue.put((index, stats, None))
    except BaseException as e:  # the parent waits for one message per partition
        queue.put((index, None, str(e) if isinstance(e, MegaliteError) else repr(e)))


def encode_partitions(args):
    total = _count_lines(args.input)
    bounds = [total * i // args.partitions for i in range(args.partitions + 1)]
    queue = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_encode_partition,
                                     args=(args, i, bounds[i], bounds[i + 1], queue))
             for i in range(args.partitions)]
    for proc in procs:
        proc.start()
    results = sorted(queue.get() for _ in procs)
    for proc in procs:
        proc.join()
    try:
        errors = [error for _, _, error in results if error is not None]
        if errors:
            raise DataError("; ".join(errors))
        _join_partitions(args, len(procs))
    finally:
        _remove_partitions(args, len(procs))
    stats = Stats()
    for _, part, _ in results:
        stats.add(part)
    return stats


def _join_partitions(args, count):
    tokenizer = build_tokenizer(args.tokenizer_type, **tokenizer_kwargs(args))
    for key in args.json_keys:
        final = output_prefix(args.output_prefix, key)
        with IndexedDatasetBuilder(final + ".bin", best_dtype(tokenizer.vocab_size)) as builder:
            for i in range(count):
                builder.add_index(output_prefix(f"{args.output_prefix}_part{i}", key))
            builder.finalize(final + ".idx")


def _remove_partitions(args, count):
    for i, key in itertools.product(range(count), args.json_keys):
        for suffix in (".bin", ".idx"):
            path = output_prefix(f"{args.output_prefix}_part{i}", key) + suffix
            if os.path.exists(path):
                os.remove(path)


def _summary(args, stats, elapsed):
    print(f"Read {stats.lines} lines ({stats.bytes / 2**20:.2f} MB) in {elapsed:.1f} s: "
          f"{stats.lines / elapsed:.1f} docs/s, {stats.bytes / elapsed / 2**20:.2f} MB/s; "
          f"{stats.skipped} skipped.")
    for key in args.json_keys:
        print(f"{output_prefix(args.output_prefix, key)}.bin/.idx: "
              f"{stats.lines - stats.skipped} documents ({stats.empty[key]} empty), "
              f"{stats.sequences[key]} sequences, {stats.tokens[key]} tokens.")


def main(argv=None):
    try:
        args = get_args(argv)
        if args.append_eod:
            tokenizer = build_tokenizer(args.tokenizer_type, **tokenizer_kwargs(args))
            if tokenizer.eod is None:
                raise ConfigError(f"--append-eod: the {args.tokenizer_type} has no "
                                  "end-of-document (eos) id")
        start = time.time()
        if args.partitions == 1:
            stats = encode_lines(args, args.output_prefix, args.workers)
        else:
            stats = encode_partitions(args)
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _summary(args, stats, max(time.time() - start, 1e-9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
