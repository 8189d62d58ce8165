"""The cluster check's phases in order, over one model: what tools/check_cluster.py runs."""

import time

from megalite.cluster_check.checkpoint import check_checkpoint
from megalite.cluster_check.collectives import check_collectives
from megalite.cluster_check.correctness import check_correctness, checked_configs
from megalite.cluster_check.recovery import check_recovery
from megalite.cluster_check.scaling import check_scaling
from megalite.cluster_check.tuning import check_tuning, tune_candidates
from megalite.parallel_state import print_rank_0

# A GPT small enough for a CPU that still has every axis to split: 8 heads in 4 query
# groups (TP up to 4), 4 layers (PP up to 4, or 2 x 2 virtual), 32 tokens (CP up to 4
# with SP), an odd vocabulary (TP pads it). fp32, dropout 0: the contract's conditions.
# No biases and Adam's eps at 1e-4: Adam divides a gradient by its own RMS, so with the
# default 1e-8 a gradient that is zero in exact arithmetic (the K bias) or nearly so turns
# its round-off into a step of up to lr, and values after an update differ by ~lr, as a
# layout bug would make them.
MODEL = ["--mock-data", "--vocab-size", "61", "--make-vocab-size-divisible-by", "1",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "4", "--swiglu",
         "--ffn-hidden-size", "96", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--seq-length", "32",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "3e-3",
         "--disable-bias-linear", "--adam-eps", "1e-4",
         "--weight-decay", "0.1", "--clip-grad", "0.5", "--seed", "1234",
         "--train-iters", "1000", "--num-workers", "0"]
CHECKS = ["correctness", "collectives", "scaling", "checkpoint", "recovery"]


def run_checks(model: list[str], args, rank: int, world: int, device) -> tuple[list, dict]:
    """(the report's sections, its charts) of the checks `args.checks` names, then --tune's;
    every rank of the launch calls it."""
    sections, charts, measured = [], {}, {}
    # Enumerated first: the collectives check measures what these layouts send too.
    lean, notes = tune_candidates(model, args, world, device) if args.tune else ([], [])
    checked = checked_configs(model, args, world)
    checks = {"correctness": lambda: check_correctness(model, args, rank, world, device),
              "collectives": lambda: check_collectives(args, rank, world, device,
                                                       checked + [c.config for c in lean],
                                                       measured),
              "scaling": lambda: check_scaling(model, args, rank, world, device, charts),
              "checkpoint": lambda: check_checkpoint(model, args, rank, world, device),
              "recovery": lambda: check_recovery(model, args, rank, world)}
    if args.tune:
        checks["tune"] = lambda: check_tuning(model, args, rank, world, device, measured, lean,
                                              notes)
    for name in args.checks + (["tune"] if args.tune else []):
        print_rank_0(f"check_cluster: {name}")
        start = time.perf_counter()
        sections.append(checks[name]())
        sections[-1].seconds = time.perf_counter() - start
        if measured and name == "collectives":
            charts["busbw.png"] = measured
    return sections, charts

