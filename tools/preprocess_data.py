"""Tokenize a corpus into Megatron's indexed-dataset format (.bin/.idx, docs/design.md §7).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \\
        --append-eod --workers 2

writes `data/corpus_text_document.bin/.idx`, one pair per `--json-keys` key, with the same
bytes Megatron-LM's tools/preprocess_data.py writes for the same input, tokenizer and flags.
Each line is a JSON object whose key holds a string (one sequence) or, as in Megatron, a
list of strings (one sequence each).

`--input` may also be a directory or a glob of JSONL (plain, .gz, .zst), Parquet and Arrow
files, or a `datasets` save_to_disk directory (megalite/data/document_sources.py); a column
holds what a JSON key would. The files are read in sorted path order as one stream, so the
output has the bytes of the same documents given as one JSONL file. --output-per-input
(megalite's own) writes one output per input file instead.

Order: documents keep the input order whatever --workers and --partitions are.
--partitions N cuts one JSONL input into N contiguous line ranges encoded side by side and
concatenated (Megatron's --keep-sequential-samples order, so the bytes do not depend on N).

Memory is bounded whatever the input size: rows are read in chunks of CHUNK_LINES (Parquet:
batches of that many rows; Arrow: the writer's record batches) and at most 2 x workers
chunks are in flight per partition, so at most (2 x workers + 1) x CHUNK_LINES documents
(the raw row and its token ids) are held at once; besides that only the index grows
(4 bytes per sequence and 8 per document).

Bad input (malformed JSON, a missing key or null value, invalid UTF-8, text that is not a
string, a token id outside the vocabulary) is reported as `file:line: reason` (Parquet and
Arrow: `file: row n: reason`); so is a file that cannot be read on (unreadable, a corrupt
Parquet page, a truncated .gz/.zst stream, a missing column). --on-error fail (default)
stops there with exit 1 and leaves no output; --on-error skip drops the line (or the rest
of the file) and counts it. An empty document gives no sequence but, as in Megatron, a
document boundary; the summary counts them. Outputs are written under temporary names and
renamed at the end (--output-per-input: each when its file is done).
"""

import argparse
import collections
import dataclasses
import itertools
import json
import multiprocessing
import os
import sys
import time

import numpy as np

from megalite.data import remote_data
from megalite.data.document_sources import (FORMATS, ShardError, check_dependencies,
                                             open_jsonl, read_records, resolve_inputs)
from megalite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megalite.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from megalite.errors import ConfigError, DataError, MegaliteError
from megalite.object_storage.paths import check_storage_path, is_object_url, mirror_path

CHUNK_LINES = 64


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True,
                       help="a file, a directory or a glob of JSONL (.jsonl/.json, optionally "
                       ".gz or .zst), Parquet (.parquet) or Arrow (.arrow) files, or a "
                       "directory written by datasets' save_to_disk; read in sorted path order")
    group.add_argument("--input-format", choices=FORMATS,
                       help="megalite's own: read every input file as this format "
                       "(default: from each file's extension or the directory's state.json)")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys (Parquet/Arrow: columns) whose text is tokenized, one "
                       "output dataset per key")
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
                       help="writes {prefix}_{key}_document.bin/.idx; an s3://bucket/prefix is "
                       "written under the system's temporary directory, then uploaded "
                       "(.bin before .idx)")
    group.add_argument("--output-per-input", action="store_true",
                       help="megalite's own: one output per input file, "
                       "{prefix}_{file name without extension}_{key}_document.bin/.idx "
                       "(default: one output for all inputs, in input order)")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes in all")
    group.add_argument("--partitions", type=int, default=1,
                       help="input ranges encoded side by side (workers split among them)")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="print progress every this many documents")
    group.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                       help="on a bad input line or row: stop with exit 1, or skip it and "
                       "count it (a file unreadable from some row on: skip the rest of it)")
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
    args.sources = resolve_inputs(args.input, args.input_format)
    check_dependencies(args.sources)
    if args.partitions > 1 and (len(args.sources) > 1
                                or not args.sources[0].format.startswith("jsonl")):
        raise ConfigError(f"--partitions {args.partitions} splits one JSONL file; --input "
                          f"{args.input} is {len(args.sources)} {args.sources[0].format} "
                          "file(s): use --workers alone")
    _check_output_names(args)
    check_storage_path("--output-prefix", args.output_prefix)
    args.upload_prefix = None
    if is_object_url(args.output_prefix):  # written into the cache, then uploaded
        args.upload_prefix, args.output_prefix = (args.output_prefix,
                                                  str(mirror_path(args.output_prefix, None)))
        os.makedirs(os.path.dirname(args.output_prefix), exist_ok=True)
    out_dir = os.path.dirname(args.output_prefix) or "."
    if not os.path.isdir(out_dir):
        raise DataError(f"--output-prefix {args.output_prefix}: directory {out_dir} not found")


def _check_output_names(args):
    if not args.output_per_input:
        return
    seen = {}
    for source in args.sources:
        if source.stem in seen:
            raise ConfigError(f"--output-per-input: {seen[source.stem]} and {source.path} "
                              f"would both write {args.output_prefix}_{source.stem}_*")
        seen[source.stem] = source.path


def output_prefixes(args):
    """The prefix each input file's documents go to (one for all unless per input)."""
    if args.output_per_input:
        return [f"{args.output_prefix}_{source.stem}" for source in args.sources]
    return [args.output_prefix] * len(args.sources)


def upload_outputs(args):
    """With --output-prefix s3://...: every dataset written, from the cache to the bucket."""
    if args.upload_prefix is None:
        return
    for prefix in sorted(set(output_prefixes(args))):
        for key in args.json_keys:
            local = output_prefix(prefix, key)
            remote_data.upload(local, args.upload_prefix + local[len(args.output_prefix):])
            for suffix in remote_data.SUFFIXES:  # staged only
                os.remove(local + suffix)
            print(f"uploaded {local}.bin/.idx to "
                  f"{args.upload_prefix + local[len(args.output_prefix):]}.bin/.idx")


def tokenizer_kwargs(args):
    return dict(tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                merge_file=args.merge_file, vocab_size=args.vocab_size)


def output_prefix(prefix, key):
    return f"{prefix}_{key}_document"


# ---- worker side: one record -> token ids per key, or the reason it is unusable ----

_worker = {}


def _init_worker(args):
    tokenizer = build_tokenizer(args.tokenizer_type, **tokenizer_kwargs(args))
    _worker.update(tokenizer=tokenizer, keys=args.json_keys,
                   eod=tokenizer.eod if args.append_eod else None)


class _BadLine(Exception):
    pass


@dataclasses.dataclass
class _Unreadable:
    """A file that could not be read on: sent through the workers so that it is reported
    in input order, after the rows read before it."""
    message: str  # the ShardError's (an exception with its own fields does not unpickle)


def _encode_chunk(chunk):
    return [(where, nbytes, _encode_record(payload)) for where, nbytes, payload in chunk]


def _encode_record(payload):
    """{key: (token ids, sequence lengths)}, or a str saying why the record is unusable.

    A payload is a JSONL line (bytes), a columnar row (a dict), or an _Unreadable."""
    if isinstance(payload, _Unreadable):
        return payload
    try:
        data = _parse(payload) if isinstance(payload, bytes) else payload
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
    if value is None:  # JSON null, or a null cell of a Parquet/Arrow column
        raise _BadLine(f"key {key!r} is null")
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
    unreadable: int = 0  # files cut short by a read error (--on-error skip)
    sequences: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    empty: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, other):
        self.lines += other.lines
        self.bytes += other.bytes
        self.skipped += other.skipped
        self.unreadable += other.unreadable
        for field in ("sequences", "tokens", "empty"):
            getattr(self, field).update(getattr(other, field))


def _records(args, start=0, stop=None):
    """((file index, row), bytes, payload) for every input row in order; with one file,
    rows start+1 .. stop only (a --partitions range). A file unreadable from some row on
    ends with an _Unreadable record there."""
    for index, source in enumerate(args.sources):
        try:
            records = read_records(source, args.json_keys, CHUNK_LINES)
            for row, nbytes, payload in itertools.islice(records, start, stop):
                yield (index, row), nbytes, payload
        except ShardError as e:
            yield (index, e.row), 0, _Unreadable(str(e))


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


class _Outputs:
    """The builders being written: one set per output prefix, finalized when the input
    moves on to a file with another prefix (--output-per-input), discarded on error."""

    def __init__(self, args, prefixes, dtype, vocab_size):
        self.args, self.prefixes, self.dtype, self.vocab_size = args, prefixes, dtype, vocab_size
        self.index, self.builders = 0, self._open(prefixes[0])

    def _open(self, prefix):
        return {key: IndexedDatasetBuilder(output_prefix(prefix, key) + ".bin", self.dtype,
                                           self.vocab_size) for key in self.args.json_keys}

    def for_file(self, index):
        """The builders of file `index`; files skipped over (no rows) get empty outputs."""
        while self.index < index:
            self.index += 1
            if self.prefixes[self.index] != self.prefixes[self.index - 1]:
                self._finalize(self.prefixes[self.index - 1])
                self.builders = self._open(self.prefixes[self.index])
        return self.builders

    def finalize(self):
        self.for_file(len(self.prefixes) - 1)
        self._finalize(self.prefixes[-1])

    def _finalize(self, prefix):
        for key, builder in self.builders.items():
            builder.finalize(output_prefix(prefix, key) + ".idx")
        self.builders = {}

    def discard(self):
        for builder in self.builders.values():
            builder.discard()


def encode_lines(args, prefixes, workers, start=0, stop=None, label=""):
    """Encode the input (rows start+1..stop of a single file) into the files'
    `{prefix}_{key}_document.*`; return Stats."""
    tokenizer = build_tokenizer(args.tokenizer_type, **tokenizer_kwargs(args))
    stats, progress = Stats(), _Progress(args.log_interval, label)
    outputs = _Outputs(args, prefixes, best_dtype(tokenizer.vocab_size), tokenizer.vocab_size)
    try:
        with multiprocessing.Pool(workers, _init_worker, (args,)) as pool:
            chunks = _chunks(_records(args, start, stop), CHUNK_LINES)
            for (index, row), nbytes, doc in _imap_bounded(pool, _encode_chunk, chunks,
                                                           2 * workers):
                builders = outputs.for_file(index)
                if isinstance(doc, _Unreadable):
                    _unreadable(args, doc.message, stats)
                    continue
                stats.lines, stats.bytes = stats.lines + 1, stats.bytes + nbytes
                if isinstance(doc, str):
                    _bad_line(args, args.sources[index].where(row), doc, stats)
                else:
                    _add_document(builders, doc, stats)
                progress.update(stats)
        outputs.finalize()
    except BaseException:
        outputs.discard()
        raise
    return stats


def _bad_line(args, where, reason, stats):
    if args.on_error == "fail":
        raise DataError(f"{where}: {reason} (use --on-error skip to skip such lines)")
    print(f"{where}: {reason} (skipped)", file=sys.stderr)
    stats.skipped += 1


def _unreadable(args, message, stats):
    if args.on_error == "fail":
        raise DataError(f"{message} (use --on-error skip to skip the rest of such files)")
    print(f"{message} (rest of the file skipped)", file=sys.stderr)
    stats.unreadable += 1


def _add_document(builders, doc, stats):
    for key, (ids, lengths) in doc.items():
        builders[key].add_document(ids, lengths)
        stats.sequences[key] += len(lengths)
        stats.tokens[key] += ids.size
        stats.empty[key] += ids.size == 0


# ---- partitions: contiguous line ranges encoded by separate processes, then joined ----

def _count_lines(source):
    count, last = 0, b"\n"
    try:
        with open_jsonl(source) as f:
            while block := f.read(1 << 24):
                count, last = count + block.count(b"\n"), block[-1:]
    except (OSError, EOFError) as e:  # a truncated .gz: the partitions cannot be cut
        raise DataError(f"{source.path}: cannot read to the end to cut --partitions: {e}")
    return count + (last != b"\n")


def _encode_partition(args, index, start, stop, queue):
    try:
        stats = encode_lines(args, [f"{args.output_prefix}_part{index}"],
                             args.workers // args.partitions, start, stop,
                             label=f"[partition {index}] ")
        queue.put((index, stats, None))
    except BaseException as e:  # the parent waits for one message per partition
        queue.put((index, None, str(e) if isinstance(e, MegaliteError) else repr(e)))


def encode_partitions(args):
    total = _count_lines(args.sources[0])
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
    print(f"Read {stats.lines} documents ({stats.bytes / 2**20:.2f} MB) from "
          f"{len(args.sources)} file(s) in {elapsed:.1f} s: {stats.lines / elapsed:.1f} docs/s, "
          f"{stats.bytes / elapsed / 2**20:.2f} MB/s; {stats.skipped} skipped"
          + (f"; {stats.unreadable} file(s) cut short by a read error." if stats.unreadable
             else "."))
    where = f"{args.output_prefix}_*" if args.output_per_input else args.output_prefix
    for key in args.json_keys:
        print(f"{output_prefix(where, key)}.bin/.idx: "
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
            stats = encode_lines(args, output_prefixes(args), args.workers)
        else:
            stats = encode_partitions(args)
        upload_outputs(args)
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _summary(args, stats, max(time.time() - start, 1e-9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
