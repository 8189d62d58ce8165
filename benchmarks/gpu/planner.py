"""planner.py FRACTION FLAGS...: the largest micro-batch whose plan (the memory planner's
most loaded rank for pretrain_gpt.py FLAGS) fits in FRACTION of this GPU's memory."""
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from benchmarks.gpu.runs import planned_bytes


def pick_micro_batch(fraction: float, flags: list[str], choices, gib: float) -> tuple[int, float]:
    """The largest micro-batch (global batch = 2 micro-batches) planned within fraction of
    gib; 1 if none is."""
    for mbs in choices:
        total = planned_bytes(flags + ["--micro-batch-size", str(mbs),
                                       "--global-batch-size", str(2 * mbs)]) / 2**30
        if total <= fraction * gib or mbs == 1:
            return mbs, total
    raise ValueError("no micro-batch choices")


if __name__ == "__main__":
    # planner.py FRACTION FLAGS...: prints the micro-batch; the plan on stderr.
    import os
    import torch
    fraction, flags = float(sys.argv[1]), sys.argv[2:]
    gib = (torch.cuda.get_device_properties(0).total_memory / 2**30
           if torch.cuda.is_available() else 80.0)
    choices = (2, 1) if os.environ.get("SMOKE") == "1" else (32, 16, 8, 4, 2, 1)
    mbs, total = pick_micro_batch(fraction, flags, choices, gib)
    print(f">> planner: micro-batch {mbs} -> {total:.3g} GiB planned of {gib:.0f} GiB",
          file=sys.stderr)
    print(mbs)
