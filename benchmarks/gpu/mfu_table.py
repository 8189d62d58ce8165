"""mfu_table.py LOG MATMUL_FILE [PEAK_OVERRIDE]: the MFU a bf16 run logged against megalite's
peak table (monitoring/peak_flops.py) for the GPU found here, and the table's entry
against a bf16 matmul measured on it.

- every log line's MFU (%) equals 100 x its TFLOP/s over the table's bf16 peak for this
  card (to the 4 significant digits both are printed with);
- the measured matmul rate (matmul_peak.py's file) lies between 60% and 100% of that peak:
  a table entry for another card of the family (an SXM peak for a PCIe or NVL card) puts
  it outside. On a CPU (SMOKE) there is no table entry: the run's --peak-tflops
  (PEAK_OVERRIDE) stands in for it, and the matmul range is not checked.
"""

import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.gpu.runs import GPU, Checks, relative
from megalite.monitoring.peak_flops import device_key, device_name, mfu_percent, peak_tflops
from megalite.training_log import parse_log

PRINTED = 1e-3  # two values each rounded to 4 significant digits
MATMUL_RANGE = (0.6, 1.0)


def main():
    log, matmul_file = sys.argv[1], sys.argv[2]
    check = Checks()
    device = torch.device("cuda" if GPU else "cpu")
    peak = peak_tflops(device, "bf16") if GPU else float(sys.argv[3])
    name = device_name(device) if GPU else "the CPU (--peak-tflops)"
    if not check("table entry", peak is not None, f"{name}: "
                 f"{device_key(name) if GPU else 'override'} -> {peak} TFLOP/s dense bf16"):
        check.exit()
    rows = [r for r in parse_log(open(log, errors="replace").read())
            if r["tflops_per_gpu"] is not None]
    worst = max((relative(mfu_percent(r["tflops_per_gpu"], peak), r["mfu_percent"])
                 for r in rows if r["mfu_percent"]), default=None)
    check("log line MFU = TFLOP/s / table peak", bool(rows) and all(
        r["mfu_percent"] for r in rows) and worst <= PRINTED,
        f"{len(rows)} log lines; last: {rows[-1]['tflops_per_gpu'] if rows else '?'} TFLOP/s, "
        f"MFU {rows[-1]['mfu_percent'] if rows else '?'}%; max relative difference "
        f"{worst if worst is None else f'{worst:.1e}'} (tol {PRINTED:.0e})")
    measured = float(open(matmul_file).read())
    low, high = (f * peak for f in MATMUL_RANGE)
    if GPU:
        check("measured matmul within the table's peak", low <= measured <= high,
              f"{measured:.1f} TFLOP/s = {mfu_percent(measured, peak):.1f}% of {peak} "
              f"(expected {MATMUL_RANGE[0]:.0%}-{MATMUL_RANGE[1]:.0%})")
    else:
        print(f">> matmul {measured:.3g} TFLOP/s on the CPU: range not checked")
    check.exit()


if __name__ == "__main__":
    main()
