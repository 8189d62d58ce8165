"""A run's time and cost, and on spot its preemptions and checkpoint interval
(docs/design.md §29).

Time = tokens x FLOPs per token / (GPUs x dense peak x MFU), the FLOPs per token being the
MFU's own count (training_log.num_floating_point_operations), so a planned MFU and a logged
one mean the same thing.

On spot the run saves every T seconds of work, each save taking C, and the job is
preempted at random with mean time M between preemptions (the fleet's rate per node times
the nodes whose loss stops it); a preemption loses the work since the last save and costs
R to restart. With memoryless preemptions a segment of T + C seconds takes
(M + R)(e^{(T+C)/M} - 1) seconds on average (retry until one attempt outlives it), so a run
of W seconds of work takes W/T of them. Young (1974) minimised the first-order expansion,
C/T + T/(2M): the best interval is about sqrt(2 C M) when C << M (Daly 2006 refines it to
sqrt(2 C M) - C; the two differ by the save time, well inside the flat minimum).
"""

import math
from dataclasses import dataclass

from megalite.config import GPTConfig
from megalite.training_log import num_floating_point_operations


def flops_per_token(model: GPTConfig) -> float:
    """Training FLOPs of one token as the MFU counts them: one sequence's over its length."""
    return num_floating_point_operations(model, 1) / model.seq_length


def run_seconds(tokens: float, flops_token: float, gpus: int, peak_tflops: float,
                mfu: float) -> float:
    """Wall-clock seconds of `tokens` on `gpus` GPUs at `mfu` of their dense peak."""
    return tokens * flops_token / (gpus * peak_tflops * 1e12 * mfu)


def optimal_interval(save_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval, seconds of work between saves: sqrt(2 C M)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


@dataclass(frozen=True)
class SpotRun:
    """`work_s` seconds of training saved every `interval_s` (each save `save_s`), with a
    mean `mtbf_s` between preemptions and `restart_s` to come back from each."""
    work_s: float
    interval_s: float
    save_s: float
    mtbf_s: float
    restart_s: float = 0.0

    @property
    def segments(self) -> float:
        return self.work_s / self.interval_s

    @property
    def preemptions(self) -> float:
        """Expected preemptions: each segment's failed attempts, e^{(T+C)/M} - 1."""
        return self.segments * math.expm1((self.interval_s + self.save_s) / self.mtbf_s)

    @property
    def total_s(self) -> float:
        """Expected wall-clock seconds, saves, lost work and restarts included."""
        return self.preemptions * (self.mtbf_s + self.restart_s)

    @property
    def lost_s(self) -> float:
        """Expected seconds of work done again (since the last save, at each preemption)."""
        return (self.total_s - self.work_s - self.segments * self.save_s
                - self.preemptions * self.restart_s)
