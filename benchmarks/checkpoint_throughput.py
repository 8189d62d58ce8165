"""Checkpoint save and load throughput (GB/s), next to this disk's raw sequential speed.

One process (a one-rank gloo group) builds a GPT the way megalite/training.py does (fp32,
plain AdamW), takes one real training step so Adam's moments exist, then times
`save_checkpoint` and `load_checkpoint` into a freshly built model and optimizer (and
checks that the load restored every weight and moment exactly). Bytes are the sizes of
the files in the published iter_* directory. References measured in the same run, on the
same number of bytes in the same directory: a plain Python sequential write to a new file
in 64 MiB chunks (without and with os.fsync), a sequential read, the same through
O_DIRECT (no page cache: the disk itself), and filling as many bytes of fresh memory.
Each row is the best of --repeat rounds, with the CPU seconds of that run.

A read right after a write is served from the page cache. "Cold" reads first drop the
file's pages with posix_fadvise(DONTNEED) (after the fsync, so the pages are clean), for
the raw file and the checkpoint files alike; "page cache" reads re-read what is cached.
On a virtual disk the host may still cache below the guest, so cold is an upper bound.

On a GPU (--device cuda, the default when one is visible; a one-rank NCCL group) the model
and optimizer live on the GPU, so save includes the copies to the host and load the
copies back: what a training job pays.

    python benchmarks/checkpoint_throughput.py [--dir DIR --num-layers 8 --hidden-size 768]
    python benchmarks/checkpoint_throughput.py --device cpu

SMOKE=1 (benchmarks/common/smoke.py): a 2-layer hidden-64 model, one round, under $TMPDIR.
"""

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist

from benchmarks.common.checkpoint_run import Run, add_run_args, build_config, init_one_rank
from benchmarks.common.smoke import shrink
from megalite.parallel_state import ParallelState

CHUNK = 64 * 2 ** 20


def drop_page_cache(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_write(path: Path, nbytes: int, fsync: bool, block: bytes):
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(block)[:min(left, CHUNK)])
        if fsync:
            os.fsync(f.fileno())


def raw_read(path: Path):
    buffer = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


def direct_io(path: Path, nbytes: int, write: bool, block: bytes):
    """O_DIRECT (no page cache) in CHUNK requests: what the disk itself does. O_DIRECT
    needs a page-aligned buffer (an anonymous mmap is) and sizes in whole blocks."""
    buffer = mmap.mmap(-1, CHUNK)
    buffer.write(block)
    left = -(-nbytes // 4096) * 4096
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY
    fd = os.open(path, flags | os.O_DIRECT)
    try:
        while left > 0:
            view = memoryview(buffer)[:min(left, CHUNK)]
            left -= os.write(fd, view) if write else os.readv(fd, [view])
        if write:
            os.fsync(fd)
    finally:
        os.close(fd)


def fill_fresh_memory(nbytes: int):
    """Every clone, and every new page-cache page, first touches memory the process or the
    kernel did not hold: where that is slow (a VM whose host takes freed memory back),
    copies cost more than the bytes they move."""
    torch.empty(nbytes, dtype=torch.uint8).fill_(1)


def check_restored(saved: Run, loaded: Run):
    for (name, p), q in zip(saved.model.named_parameters(), loaded.model.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs after loading"
    for p, q in zip(saved.optimizer.params, loaded.optimizer.params):
        a, b = saved.optimizer.adam.state[p], loaded.optimizer.adam.state[q]
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


class Clock:
    """Best (least wall) of the repeats of each named measurement, with its CPU seconds.
    CPU time counts this process's user and system time (copies into the page cache are
    system time), not the waits for the disk or for a busy machine's cores."""

    def __init__(self):
        self.best: dict[str, tuple[float, float]] = {}

    def time(self, what: str, fn, *args):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn(*args)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if what not in self.best or wall < self.best[what][0]:
            self.best[what] = (wall, cpu)
        return result


def measure_once(clock: Clock, saved: Run, tmp: str) -> int:
    """One round: save, the raw references on as many bytes, load cold and warm. Returns
    the checkpoint's bytes."""
    save_dir = os.path.join(tmp, "ckpt")
    shutil.rmtree(save_dir, ignore_errors=True)
    directory = clock.time("save_checkpoint (fsyncs each file)", saved.save, save_dir, 1)
    files = sorted(directory.iterdir())
    nbytes = sum(f.stat().st_size for f in files)

    # Each raw write makes a new file, as a save does, and nothing is deleted in between:
    # overwriting or deleting a file hands its page-cache pages to the next write, which
    # on this kind of VM is much cheaper than growing the cache (see fill_fresh_memory).
    raws, block = [Path(tmp) / "raw0.bin", Path(tmp) / "raw1.bin"], os.urandom(CHUNK)
    clock.time("raw write, no fsync (page cache)", raw_write, raws[0], nbytes, False, block)
    clock.time("raw write + fsync", raw_write, raws[1], nbytes, True, block)
    clock.time("raw read, page cache", raw_read, raws[1])
    drop_page_cache(raws[1])
    clock.time("raw read, cold (fadvise DONTNEED)", raw_read, raws[1])
    for raw in raws:
        raw.unlink()
    raw = Path(tmp) / "direct.bin"
    try:
        clock.time("disk: O_DIRECT write + fsync", direct_io, raw, nbytes, True, block)
        clock.time("disk: O_DIRECT read", direct_io, raw, nbytes, False, block)
    except (AttributeError, OSError) as error:  # no O_DIRECT here (tmpfs, macOS)
        print(f"  no O_DIRECT rows: {error}")
    raw.unlink(missing_ok=True)

    for what in ("load_checkpoint, cold", "load_checkpoint, page cache"):
        fresh = Run(saved.config, saved.state, saved.device)
        if what.endswith("cold"):
            for f in files:  # right before, as for the raw read
                drop_page_cache(f)
        clock.time(what, fresh.load, save_dir)
        check_restored(saved, fresh)
        del fresh
    clock.time("fill fresh memory (no disk)", fill_fresh_memory, nbytes)
    return nbytes


def describe(args, saved: Run, tmp: str):
    psi = sum(p.numel() for p in saved.model.parameters())
    print(f"{args.num_layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}: "
          f"{psi / 1e6:.2f}M fp32 parameters, plain AdamW (fp32 main = the parameters)")
    for f in sorted(Path(tmp, "ckpt").glob("iter_*/*")):
        print(f"  {f.name:28s} {f.stat().st_size:>13,} bytes")


REFERENCE = {"save_checkpoint (fsyncs each file)": "raw write + fsync",
             "load_checkpoint, cold": "raw read, cold (fadvise DONTNEED)",
             "load_checkpoint, page cache": "raw read, page cache"}
ORDER = ["fill fresh memory (no disk)", "disk: O_DIRECT write + fsync", "disk: O_DIRECT read",
         "raw write, no fsync (page cache)", "raw write + fsync",
         "save_checkpoint (fsyncs each file)", "raw read, cold (fadvise DONTNEED)",
         "raw read, page cache", "load_checkpoint, cold", "load_checkpoint, page cache"]


def print_table(clock: Clock, nbytes: int):
    print("\n| what | bytes | seconds | CPU seconds | GB/s | ratio to raw |")
    print("|---|---:|---:|---:|---:|---|")
    for what in [w for w in ORDER if w in clock.best]:
        wall, cpu = clock.best[what]
        ref = REFERENCE.get(what)
        ratio = f"{clock.best[ref][0] / wall:.2f} × {ref}" if ref else ""
        print(f"| {what} | {nbytes:,} | {wall:.2f} | {cpu:.2f} | {nbytes / wall / 1e9:.2f} "
              f"| {ratio} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--repeat", type=int, default=2, help="Rounds; the best of each is shown.")
    args = shrink(p.parse_args(), dir=tempfile.gettempdir(), num_layers=2, hidden_size=64,
                  vocab_size=512, repeat=1)
    device = init_one_rank(args.device)
    clock = Clock()
    try:
        with tempfile.TemporaryDirectory(prefix="ckpt_bench_", dir=args.dir) as tmp:
            print(f"torch {torch.__version__}, {os.cpu_count()} cores, model on {device}, "
                  f"directory {tmp}")
            config = build_config(args, os.path.join(tmp, "ckpt"))
            saved = Run(config, ParallelState(config.parallel.grid, 0), device)
            clock.time("one training step (b=1, s=32)", saved.train_step)
            for _ in range(args.repeat):
                nbytes = measure_once(clock, saved, tmp)
            describe(args, saved, tmp)
    finally:
        dist.destroy_process_group()
    print(f"one training step (b=1, s=32) before saving: "
          f"{clock.best['one training step (b=1, s=32)'][0]:.1f} s; best of {args.repeat} rounds")
    print_table(clock, nbytes)


if __name__ == "__main__":
    main()
