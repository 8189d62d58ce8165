"""What the cluster check's phases share: the repository they launch from, the targets they
report against, a layout's batch flags, an object gathered from every rank, and a layout's
steps timed in processes of their own."""

import os

import torch.distributed as dist

from megalite.layout_trial import Trial, time_layout

# pretrain_gpt.py and examples/configs/ (the recovery and checkpoint phases use them).
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TARGETS = {"scaling to 8": 0.9, "scaling at 32": 0.8, "13B save (s)": 120.0,
           "recovery (s)": 300.0}
# Test-only: "<rank>:<layout name>" makes that rank's trial of that layout (the tuner's
# name for it) run out of memory in its first step.
TEST_HOOK = "MEGALITE_CHECK_CLUSTER_TEST_OOM"


def batch_flags(global_batch: int, micro: int = 1) -> list[str]:
    return ["--micro-batch-size", str(micro), "--global-batch-size", str(global_batch)]


def gathered(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def time_steps(flags: list[str], world: int, rank: int, device, steps: int,
               name: str = "") -> Trial:
    """The trial of `flags` on the first `world` ranks: the slowest rank's median seconds
    per step after one warm-up step and the most any rank's memory grew, or the rank that
    ran out of memory, which ends the trial and not the check (megalite/layout_trial.py)."""
    inject = os.environ.get(TEST_HOOK) == f"{rank}:{name}"
    return time_layout(flags, world, rank, device, steps, inject_out_of_memory=inject)
