"""parse_log.py LOG [PEAK_TFLOPS [MATMUL_TFLOPS]] [nofall]: Megatron log lines -> the last
interval's speed and MFU against the dense peak (and a bf16 matmul measured in the same run).
Fails on no line, a non-finite loss, or (unless nofall) a loss that did not fall."""
import math
import sys

from megalite.monitoring.peak_flops import mfu_percent
from megalite.training_log import parse_log_line

logs = []
for line in open(sys.argv[1], errors="replace").read().splitlines():
    log = parse_log_line(line)
    if log:
        logs.append(log)
        print(">>", line.strip()[22:])
if not logs:
    sys.exit(">> no Megatron log line in the output")
last = logs[-1]
tflops = last["tflops_per_gpu"]
msg = (f">> iteration {last['iteration']}: {last['elapsed_ms']:.1f} ms/iter, "
       f"{last['tokens_per_second']:,.0f} tokens/s")
numbers = [float(a) for a in sys.argv[2:] if a != "nofall"]
if tflops is not None:
    msg += f", {tflops:.1f} TFLOP/s/GPU"
    for name, peak in zip(("dense bf16 peak", "measured bf16 matmul"), numbers):
        if peak > 0:
            msg += f"; MFU {mfu_percent(tflops, peak):.1f}% of the {name} {peak:.4g}"
print(msg)
losses = [log["lm_loss"] for log in logs]
if not all(math.isfinite(x) for x in losses):
    sys.exit(">> non-finite loss")
if len(losses) > 1 and not losses[-1] < losses[0]:
    print(f">> loss did not fall: {losses}")
    if "nofall" not in sys.argv:
        sys.exit(1)
