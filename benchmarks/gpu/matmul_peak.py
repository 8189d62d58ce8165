"""The bf16 matmul rate of this device, measured: the ceiling a training step's GEMMs can
reach here, next to the datasheet's dense peak. Prints ">> ... TFLOP/s" and writes the
number to the file given as argv[1] (if any). Fresh random operands, rotated among three
sets (not zeros: they run faster), timed with CUDA events after a warm-up; median."""
import statistics
import sys
import time

import torch

gpu = torch.cuda.is_available()
n = 8192 if gpu else 512
dtype = torch.bfloat16 if gpu else torch.float32
device = "cuda" if gpu else "cpu"
sets = [(torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device,
                                                                  dtype=dtype))
        for _ in range(3)]
out = torch.empty(n, n, device=device, dtype=dtype)
for a, b in sets * 3:  # warm-up: cuBLAS handle, heuristics, clocks
    torch.matmul(a, b, out=out)
times = []
for i in range(30 if gpu else 5):
    a, b = sets[i % 3]
    if gpu:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    else:
        t = time.perf_counter()
        torch.matmul(a, b, out=out)
        times.append(time.perf_counter() - t)
if not torch.isfinite(out).all():
    sys.exit(">> matmul output is not finite")
tflops = 2 * n ** 3 / statistics.median(times) / 1e12
print(f">> {'bf16' if gpu else 'fp32 (CPU)'} matmul {n}^3 on {device}: {tflops:.1f} TFLOP/s "
      f"(median of {len(times)})")
if len(sys.argv) > 1:
    open(sys.argv[1], "w").write(f"{tflops:.2f}\n")
