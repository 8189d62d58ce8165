"""Peak memory and time of causal attention, forward + backward, per backend.

Each case is one core_attention call on q, k, v of [batch 1, seq, 8 heads, 64] plus its
backward, at seq 512 to 4096. Next to the measured peak stands the closed-form size of
the fp32 score matrix, seq x seq x heads x 4 bytes: what `unfused` materialises (several
times over: scores, probabilities, their gradients) and what a flash-style kernel never
stores, keeping memory linear in seq.

CPU (fp32, sdpa vs unfused): each case runs in a fresh subprocess, so one case's peak
cannot hide the next's. The child runs the backend once at seq 16 (loading its kernels'
code pages and thread pool), allocates the inputs, reads the high-water mark
resource.getrusage(RUSAGE_SELF).ru_maxrss (at that point equal to the current RSS), runs
the case once and reads it again: the difference is the peak the attention added. Large
tensors come from mmap and go back to the OS when freed, so the mark tracks live tensors.
Time is the mean of the further runs.

GPU (bf16, flash when the flash-attn package is installed, sdpa, unfused): in process,
torch.cuda.max_memory_allocated minus the memory allocated before the call.

    python benchmarks/attention_memory.py [--seqs 512 1024 2048 4096] [--repeats 3]
    python benchmarks/attention_memory.py --device cuda     # the GPU rows only

SMOKE=1 (benchmarks/common/smoke.py): seqs 128 and 256, one run each, not a measurement.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.common.smoke import shrink
from megalite.attention_backends import core_attention, flash_attn_available

HEADS, HEAD_DIM = 8, 64
MiB = 2**20


def inputs(seq, dtype=torch.float32, device="cpu"):
    shape = (1, seq, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
               for _ in range(3))
    return q, k, v, torch.randn(shape, dtype=dtype, device=device)


def fwd_bwd(backend, q, k, v, grad):
    core_attention(q, k, v, backend=backend).backward(grad)
    q.grad = k.grad = v.grad = None


def cpu_case(backend, seq, repeats):
    """Runs in the child: (peak MiB above baseline, mean seconds per forward+backward)."""
    fwd_bwd(backend, *inputs(16))
    # ru_maxrss is a high-water mark: the first full-size run must be the measured one.
    case = inputs(seq)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    fwd_bwd(backend, *case)
    first = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB on Linux
    start = time.perf_counter()
    for _ in range(repeats - 1):
        fwd_bwd(backend, *case)
    mean = (time.perf_counter() - start) / (repeats - 1) if repeats > 1 else first
    return peak / 1024, mean


def gpu_case(backend, seq, repeats):
    case = inputs(seq, torch.bfloat16, "cuda")
    fwd_bwd(backend, *case)  # warm-up: kernel selection and caching allocator pools
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(repeats):
        fwd_bwd(backend, *case)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    return (torch.cuda.max_memory_allocated() - base) / MiB, seconds


def run_child(backend, seq, repeats):
    cmd = [sys.executable, __file__, "--child", backend, str(seq), str(repeats)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per case (2 at seq >= 4096, where one run takes seconds)")
    p.add_argument("--device", choices=["all", "cpu", "cuda"], default="all",
                   help="Which rows: the CPU's, the GPU's (when one is visible), or both.")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        backend, seq, repeats = args.child[0], int(args.child[1]), int(args.child[2])
        print(json.dumps(cpu_case(backend, seq, repeats)))
        return
    shrink(args, seqs=[128, 256], repeats=1)  # in the parent: the child's stdout is its JSON

    print(f"causal attention fwd+bwd, batch 1, {HEADS} heads, head_dim {HEAD_DIM}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| device | dtype | backend | seq | peak MiB | s x s x heads x 4 B, MiB "
          "| ms fwd+bwd |")
    print("|---|---|---|---:|---:|---:|---:|")
    runs = []
    if args.device in ("all", "cpu"):
        runs += [("cpu", "fp32", b, run_child) for b in ("sdpa", "unfused")]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible to torch")
    if args.device in ("all", "cuda") and torch.cuda.is_available():
        gpu_backends = (["flash"] if flash_attn_available() else []) + ["sdpa", "unfused"]
        runs += [("gpu", "bf16", b, gpu_case) for b in gpu_backends]
    for device, dtype, backend, case in runs:
        for seq in args.seqs:
            repeats = min(args.repeats, 2) if device == "cpu" and seq >= 4096 else args.repeats
            peak, seconds = case(backend, seq, repeats)
            scores = seq * seq * HEADS * 4 / MiB
            print(f"| {device} | {dtype} | {backend} | {seq} | {peak:,.0f} | {scores:,.0f} "
                  f"| {seconds * 1e3:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
