"""moe_paths.py LOG_DIR -- FLAGS...: the MoE layer's device paths, each run against the same
model with the experts as a loop (the reference grouped_gemm.py must equal):
- grouped: --moe-grouped-gemm (torch._grouped_mm's device kernel) with the aux loss;
- empty_experts: 32 experts, top-1, 16 tokens a micro-batch: most experts get no token a
  step, so the kernel meets empty groups (their weight gradients must be zero, not whatever
  the kernel left in memory);
- expert_bias: --moe-router-enable-expert-bias (aux-loss-free balancing, sigmoid scores),
  grouped;
- expert_bias_fsdp_offload: the same under FSDP2 with --optimizer-cpu-offload and torchrun
  (buffers rebuilt after FSDP2's meta-device init, back on the compute device).
Losses and grad norms per iteration within bf16's round-off of the loop's (both runs bf16
on a GPU); every run must finish.
"""

import os
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from benchmarks.gpu.runs import Checks, relative, run_all, run_pretrain, tail
from megalite.training_log import parse_log


EXPERTS = ["--disable-bias-linear", "--num-experts"]  # experts have no biases
MOE = [*EXPERTS, "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]
EMPTY = [*EXPERTS, "32", "--moe-router-topk", "1", "--moe-aux-loss-coeff", "0",
         "--micro-batch-size", "1", "--seq-length", "16"]
BIAS = [*EXPERTS, "4", "--moe-router-topk", "2", "--moe-router-enable-expert-bias",
        "--moe-router-score-function", "sigmoid", "--moe-router-load-balancing-type", "none"]
FSDP_OFFLOAD = ["--use-torch-fsdp2", "--optimizer-cpu-offload"]
GROUPED = ["--moe-grouped-gemm"]
LOSS, NORM = 2e-2, 5e-2  # bf16: the grouped kernel sums in another order than the loop's


def main():
    log_dir, flags = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    check = Checks()
    cases = {"grouped": MOE, "empty_experts": EMPTY, "expert_bias": BIAS,
             "expert_bias_fsdp_offload": BIAS + FSDP_OFFLOAD}
    jobs = {}
    for name, extra in cases.items():
        nproc = 1 if "--use-torch-fsdp2" in extra else 0
        for kind, more in (("grouped", GROUPED), ("loop", [])):
            log = os.path.join(log_dir, f"moe_paths.{name}.{kind}.log")
            jobs[f"{name}.{kind}"] = (lambda log=log, f=flags + extra + more, n=nproc:
                                      run_pretrain(log, f, nproc=n))
    done = run_all(jobs)
    for name, (rc, output) in done.items():
        if not check(f"run {name}", rc == 0, "finished" if rc == 0 else f"exit {rc}"):
            print(tail(output))
    for name in cases:
        (rc_g, grouped), (rc_l, loop) = done[f"{name}.grouped"], done[f"{name}.loop"]
        if rc_g or rc_l:
            continue
        pairs = list(zip(parse_log(grouped), parse_log(loop)))
        worst = {k: max((relative(a[k], b[k]) for a, b in pairs), default=1.0)
                 for k in ("lm_loss", "grad_norm")}
        check(f"{name}: grouped GEMM vs the loop", bool(pairs) and worst["lm_loss"] <= LOSS
              and worst["grad_norm"] <= NORM, f"{len(pairs)} iterations: max relative "
              f"difference loss {worst['lm_loss']:.1e} (tol {LOSS:.0e}), grad norm "
              f"{worst['grad_norm']:.1e} (tol {NORM:.0e})")
    check.exit()


if __name__ == "__main__":
    main()
