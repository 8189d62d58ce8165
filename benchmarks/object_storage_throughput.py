"""Object storage against local disk, in the same run: what a save to and a load from a bucket
cost (docs/design.md §30).

Per round, on one file of --mib MiB of random bytes (a checkpoint file's size class):
  disk write      a sequential write in 64 MiB chunks to --dir, fsynced (a local save);
  disk read       the same file read back after its pages were dropped (cold);
  s3 upload       megalite's client (object_storage/s3.py: CRC-32 pass, multipart parts of
                  64 MiB, 8 in flight) to the server;
  s3 download     the same, into --dir, checked against the recorded size and CRC-32;
  s3 ranged GETs  --samples reads of --sample-kib KiB at random offsets, one request each,
                  of a 1 MiB object: what reading a dataset's .bin sample by sample would
                  cost a request (moto's server copies the whole object for a range, so a
                  small object isolates the round trip from that).
The server is moto's (`pip install megalite[dev]`), started on 127.0.0.1, unless
AWS_ENDPOINT_URL is set (then --bucket must exist there). Each row is the best of --repeat.

    python benchmarks/object_storage_throughput.py [--mib 256 --repeat 3 --dir /tmp]

SMOKE=1 (benchmarks/common/smoke.py): 2 MiB, one round, 20 ranged reads.
"""

import argparse
import contextlib
import os
import random
import sys
import tempfile
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common.smoke import shrink
from megalite.object_storage.local_server import s3_server
from megalite.object_storage.s3 import S3Store, S3Url

CHUNK = 64 * 2**20
RANGED_OBJECT = 2**20


def disk_write(path: Path, data: bytes) -> None:
    with open(path, "wb", buffering=0) as f:
        for i in range(0, len(data), CHUNK):
            f.write(data[i:i + CHUNK])
        os.fsync(f.fileno())


def disk_read(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # fsynced: the pages are clean
    os.close(fd)
    with open(path, "rb", buffering=0) as f:
        while f.read(CHUNK):
            pass


def ranged_reads(store: S3Store, url: S3Url, size: int, sample: int, count: int) -> None:
    rng = random.Random(0)
    for _ in range(count):
        store.get_range(url, rng.randrange(size - sample), sample)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def measure(args, store: S3Store, directory: Path) -> dict[str, tuple[float, int]]:
    """(best seconds, bytes) of each operation over --repeat rounds."""
    data = os.urandom(args.mib * 2**20)
    local, copy = directory / "file.bin", directory / "downloaded.bin"
    url = S3Url.parse(f"s3://{args.bucket}/benchmark/file.bin")
    small = S3Url.parse(f"s3://{args.bucket}/benchmark/small.bin")
    store.put(small, data[:RANGED_OBJECT])
    sample = args.sample_kib * 1024
    best: dict[str, tuple[float, int]] = {}
    for _ in range(args.repeat):
        rows = {"disk write (fsync)": (timed(disk_write, local, data), len(data)),
                "disk read (cold)": (timed(disk_read, local), len(data)),
                "s3 upload": (timed(store.upload, local, url), len(data)),
                "s3 download (verified)": (timed(store.download, url, copy), len(data)),
                f"s3 ranged GETs of {args.sample_kib} KiB": (
                    timed(ranged_reads, store, small, RANGED_OBJECT, sample, args.samples),
                    sample * args.samples)}
        assert copy.read_bytes() == data, "the download differs from the upload"
        for name, (seconds, nbytes) in rows.items():
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, nbytes)
        copy.unlink()
    return best


def print_table(best: dict[str, tuple[float, int]], args) -> None:
    print(f"\n{args.mib} MiB file, best of {args.repeat}; endpoint "
          f"{os.environ['AWS_ENDPOINT_URL']}")
    print("| operation | bytes | seconds | MB/s | per request ms |")
    print("|---|---:|---:|---:|---:|")
    for name, (seconds, nbytes) in best.items():
        per = f"{seconds / args.samples * 1e3:.2f}" if "ranged" in name else ""
        print(f"| {name} | {nbytes:,} | {seconds:.3f} | {nbytes / seconds / 1e6:.1f} | {per} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="file size (MiB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--samples", type=int, default=100, help="ranged GETs per round")
    parser.add_argument("--sample-kib", type=int, default=8,
                        help="bytes of one ranged GET (KiB; 8: a 4096-token uint16 sample)")
    parser.add_argument("--bucket", default="megalite-benchmark")
    parser.add_argument("--dir", default=None, help="local disk directory (default: $TMPDIR)")
    args = shrink(parser.parse_args(argv), mib=2, repeat=1, samples=20)
    with contextlib.ExitStack() as stack:
        if "AWS_ENDPOINT_URL" not in os.environ:
            os.environ.update(stack.enter_context(s3_server()))
            S3Store.shared().client.create_bucket(Bucket=args.bucket)
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=args.dir)))
        print_table(measure(args, S3Store.shared(), directory), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
