"""memory_snapshot.py SNAPSHOT: the CUDA memory snapshot a run with --record-memory-history
(and no --profile) wrote: a pickle torch.cuda.memory._dump_snapshot's format (segments,
their blocks, the allocator's trace), holding live allocations, and among them the
model's parameters and the gradient buffer, with the stacks that allocated them (so the
recording started before the model and optimizer were built)."""

import os
import pickle
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from benchmarks.gpu.runs import Checks


BUILT_BY = ("build_model", "build_optimizer")  # megalite/training.py


def frames_of(snapshot: dict) -> set[str]:
    """The function names in the allocation stacks of the snapshot's live blocks."""
    return {frame.get("name", "") for segment in snapshot.get("segments", [])
            for block in segment.get("blocks", []) if block.get("state") == "active_allocated"
            for frame in block.get("frames", [])}


def main():
    path, check = sys.argv[1], Checks()
    if not check("snapshot written", os.path.isfile(path),
                 f"{path} ({os.path.getsize(path) / 2**20:.1f} MiB)" if os.path.isfile(path)
                 else f"no {path}"):
        check.exit()
    try:
        snapshot = pickle.load(open(path, "rb"))
    except Exception as error:  # noqa: BLE001 (any unreadable file is the finding)
        check("snapshot readable", False, f"{type(error).__name__}: {error}")
        check.exit()
    segments = snapshot.get("segments", []) if isinstance(snapshot, dict) else []
    live = [b for s in segments for b in s.get("blocks", [])
            if b.get("state") == "active_allocated"]
    traces = sum(len(t) for t in snapshot.get("device_traces", [])) if segments else 0
    check("snapshot holds allocations", bool(live),
          f"{len(segments)} segments, {len(live)} live blocks "
          f"({sum(b.get('size', 0) for b in live) / 2**20:.1f} MiB), {traces} trace events")
    frames = frames_of(snapshot) if segments else set()
    check("model and optimizer allocations recorded", all(f in frames for f in BUILT_BY),
          f"stacks of live blocks name {', '.join(f for f in BUILT_BY if f in frames) or 'neither'}"
          f" of {', '.join(BUILT_BY)}")
    check.exit()


if __name__ == "__main__":
    main()
