"""Where one training step's time goes, from a torch.profiler chrome trace.

On a GPU: the kernels of the step, by category (GEMMs, attention, communication, the
optimizer = every kernel after the device sync that starts the optimizer step,
elementwise/norms/other), and the time the GPU ran no kernel (waiting on the host).
On a CPU: the self time of the aten ops instead (the host is the device there).
"""

import json
from collections import defaultdict

STEP, OPTIMIZER = "megalite.train_step", "megalite.optimizer"
CATEGORIES = ["GEMMs", "attention", "elementwise/norms/other", "optimizer", "communication"]
ATTENTION = ("flash", "fmha", "sdpa", "attention", "attn")
GEMM = ("gemm", "nvjet", "xmma", "matmul", "cublas", "wgmma", "aten::mm", "aten::addmm",
        "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "cutlass")
COMMUNICATION = ("nccl", "gloo", "c10d::", "all_reduce", "allreduce", "all_gather",
                 "reduce_scatter", "broadcast")


def category(name: str, start: float, optimizer_start: float | None) -> str:
    low = name.lower()
    if any(k in low for k in COMMUNICATION):
        return "communication"
    if optimizer_start is not None and start >= optimizer_start:
        return "optimizer"
    if any(k in low for k in ATTENTION):
        return "attention"
    if any(k in low for k in GEMM):
        return "GEMMs"
    return "elementwise/norms/other"


def _window(events, name):
    found = [e for e in events if e.get("name") == name and e.get("ph") == "X"]
    return (found[0]["ts"], found[0]["ts"] + found[0]["dur"]) if found else None


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _self_times(ops):
    """(op, self time) of CPU ops, nesting per thread (children's time taken out)."""
    out = []
    for tid in {e["tid"] for e in ops}:
        stack = []
        for e in sorted((e for e in ops if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"])):
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                out.append(tuple(stack.pop()))
            if stack:
                stack[-1][1] -= e["dur"]
            stack.append([e, e["dur"]])
        out += [tuple(s) for s in stack]
    return out


def summarise(path: str) -> str:
    data = json.load(open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    step = _window(events, STEP)
    if step is None:
        return ">> profile: no step annotation in the trace"
    opt = _window(events, OPTIMIZER)
    opt_start = opt[0] if opt else None
    inside = [e for e in events if e.get("ph") == "X" and step[0] <= e["ts"] <= step[1]]
    kernels = [e for e in inside if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    times = defaultdict(float)
    if kernels:
        unit = "GPU kernel time"
        for e in kernels:
            times[category(e["name"], e["ts"], opt_start)] += e["dur"]
        busy = _union((e["ts"], e["ts"] + e["dur"]) for e in kernels)
        idle_name = "GPU idle (host-bound)"
    else:
        unit = "CPU self time of aten ops"
        for e, self_us in _self_times([e for e in inside if e.get("cat") == "cpu_op"]):
            times[category(e["name"], e["ts"], opt_start)] += max(self_us, 0.0)
        busy = sum(times.values())
        idle_name = "outside aten ops (python)"
    wall = step[1] - step[0]
    lines = [f">> profile of one step: {wall / 1e3:.1f} ms wall; {unit} by category"]
    for name in CATEGORIES:
        lines.append(f">>   {name:26s} {times[name] / 1e3:9.2f} ms {100 * times[name] / wall:5.1f}%")
    idle = max(wall - busy, 0.0)
    lines.append(f">>   {idle_name:26s} {idle / 1e3:9.2f} ms {100 * idle / wall:5.1f}%")
    if kernels:
        top = defaultdict(float)
        for e in kernels:
            top[e["name"]] += e["dur"]
        for name, us in sorted(top.items(), key=lambda kv: -kv[1])[:8]:
            lines.append(f">>     top kernel {us / 1e3:8.2f} ms  {name[:90]}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    print(summarise(sys.argv[1]))
