"""parse_log.py LOG [PEAK_TFLOPS [MATMUL_TFLOPS]] [nofall]: Megatron log lines -> the last
interval's speed and MFU against the dense peak (and a bf16 matmul measured in the same run).
Fails on no line, a non-finite loss, or (unless nofall) a loss that did not fall."""
import math
import re
import sys

rows = []
for line in open(sys.argv[1], errors="replace").read().splitlines():
    it, loss = re.search(r"iteration +(\d+)/", line), re.search(r"lm loss: (\S+) \|", line)
    if it and loss:
        tf = re.search(r"TFLOP/s/GPU\): ([\d.eE+-]+) \|", line)
        tps = re.search(r"tokens per second: ([\d.]+)", line)
        rows.append((int(it.group(1)), float(loss.group(1)),
                     float(re.search(r"iteration \(ms\): ([\d.]+)", line).group(1)),
                     float(tf.group(1)) if tf else None, float(tps.group(1)) if tps else None))
        print(">>", line.strip()[22:])
if not rows:
    sys.exit(">> no Megatron log line in the output")
it, loss, ms, tflops, tps = rows[-1]
msg = f">> iteration {it}: {ms:.1f} ms/iter"
if tps is not None:
    msg += f", {tps:,.0f} tokens/s"
numbers = [float(a) for a in sys.argv[2:] if a != "nofall"]
if tflops is not None:
    msg += f", {tflops:.1f} TFLOP/s/GPU"
    for name, peak in zip(("dense bf16 peak", "measured bf16 matmul"), numbers):
        if peak > 0:
            msg += f"; MFU {100 * tflops / peak:.1f}% of the {name} {peak:.4g}"
print(msg)
losses = [r[1] for r in rows]
if not all(math.isfinite(x) for x in losses):
    sys.exit(">> non-finite loss")
if len(losses) > 1 and not losses[-1] < losses[0]:
    print(f">> loss did not fall: {losses}")
    if "nofall" not in sys.argv:
        sys.exit(1)
