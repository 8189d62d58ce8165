"""Uneven data-parallel shares (docs/design.md §15): how many micro-batches of every global
batch each DP rank computes, from weights (--data-parallel-shares 3,1) or from measured
speed (--data-parallel-shares auto).

A share decides which rank computes which samples, never which samples are in the batch:
the sampler (sampler.py) hands DP rank r the micro-batches after those of ranks 0..r-1, so
the global batch is the same samples in the same order at any shares, and the loss (a sum
over tokens divided by the global batch's token count, train_step.py) and the summed
gradients are one process's at any split. Shares change only at step boundaries, as a
pure function of times all ranks have all-gathered, so every rank computes the same ones.
"""

import torch
import torch.distributed as dist

from megalite.config import Config, ParallelConfig, TrainingConfig
from megalite.errors import ConfigError
from megalite.timers import COMPUTE, Timers
from megalite.parallel_state import ParallelState, all_gather_into, to_collective_device


def split_microbatches(weights, total: int, unit: int = 1) -> tuple[int, ...]:
    """`total` micro-batches in proportion to `weights`, each rank at least `unit` and a
    multiple of it (the largest remainders get the units left over)."""
    if total % unit or total // unit < len(weights):
        raise ConfigError(f"{total} micro-batches per global batch cannot give each of "
                          f"{len(weights)} data-parallel ranks a multiple of {unit} (>= 1)")
    if any(w <= 0 for w in weights):
        raise ConfigError(f"--data-parallel-shares weights must be positive, got {weights}")
    units = total // unit
    exact = [units * w / sum(weights) for w in weights]
    counts = [max(1, int(e)) for e in exact]
    while sum(counts) < units:  # the largest shortfall first; ties to the lower rank
        counts[max(range(len(counts)), key=lambda r: (exact[r] - counts[r], -r))] += 1
    while sum(counts) > units:  # only where a rank was raised to its one unit
        counts[max((r for r in range(len(counts)) if counts[r] > 1),
                   key=lambda r: (counts[r] - exact[r], -r))] -= 1
    return tuple(c * unit for c in counts)


def share_unit(parallel: ParallelConfig) -> int:
    """The step of a share: interleaved 1F1B runs micro-batches in groups of p."""
    v = parallel.virtual_pipeline_model_parallel_size or 1
    return parallel.pipeline_model_parallel_size if v > 1 else 1


def configured_shares(training: TrainingConfig, dp: int) -> tuple[int, ...]:
    """Micro-batches of each DP rank as configured (`auto` starts from these)."""
    return training.data_parallel_shares or (training.num_microbatches,) * dp


def share_balancer(config: Config, state: ParallelState, timers: Timers) -> "ShareBalancer":
    t = config.training
    return ShareBalancer(configured_shares(t, state.dp_size), state, timers,
                         t.data_parallel_shares_auto, t.data_parallel_shares_threshold,
                         t.data_parallel_shares_window, share_unit(config.parallel))


def parse_weights(text: str, dp: int) -> list[float] | None:
    """--data-parallel-shares: "auto" (None) or one weight per DP rank."""
    if text == "auto":
        return None
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ConfigError(f"--data-parallel-shares must be 'auto' or comma-separated "
                          f"weights, one per data-parallel rank; got {text!r}") from None
    if len(weights) != dp:
        raise ConfigError(f"--data-parallel-shares={text} gives {len(weights)} weights for "
                          f"data-parallel size {dp}")
    return weights


class ShareBalancer:
    """--data-parallel-shares auto: times each rank's own compute (the straggler timers'
    COMPUTE phases) for `window` steps, all-gathers the times, and sets the shares in
    proportion to each DP replica's speed (micro-batches per second of its slowest rank);
    after that, re-balances when a replica's speed moves by more than `threshold` from the
    speed the shares were set for. Without auto the shares stay as given. A rank's time
    includes its per-step work (the optimizer step), so a replica with few micro-batches
    looks a little slower per micro-batch than it is: the shares err towards even."""

    def __init__(self, shares: tuple[int, ...], state: ParallelState, timers: Timers,
                 auto: bool, threshold: float, window: int, unit: int = 1):
        self.shares, self.state, self.timers = shares, state, timers
        self.auto, self.threshold, self.window, self.unit = auto, threshold, window, unit
        self.speeds: list[float] | None = None  # the speeds the shares were set for
        self.measured: list[float] | None = None
        self._seconds = self._microbatches = self._steps = 0
        self._before = 0.0

    @property
    def uneven(self) -> bool:
        return len(set(self.shares)) > 1 or self.auto

    @property
    def local(self) -> int:
        """This DP rank's micro-batches per step."""
        return self.shares[self.state.dp_rank]

    def _compute_seconds(self) -> float:
        elapsed = self.timers.elapsed(reset=False)
        return sum(elapsed.get(name, 0.0) for name in COMPUTE)

    def before_step(self):
        self._before = self._compute_seconds()

    def after_step(self, iteration: int) -> bool:
        """Every rank after each step; True when the shares changed (from the next step)."""
        if not self.auto or iteration == 1:  # the first step pays for warm-up, not for speed
            return False
        self._seconds += self._compute_seconds() - self._before
        self._microbatches += self.local
        self._steps += 1
        if self._steps < self.window:
            return False
        speeds = self._gather_speeds()
        self._seconds = self._microbatches = self._steps = 0
        self.measured = speeds
        if self.speeds is not None and all(
                abs(s - old) <= self.threshold * old for s, old in zip(speeds, self.speeds)):
            return False
        self.speeds = speeds
        old, self.shares = self.shares, split_microbatches(speeds, sum(self.shares), self.unit)
        return self.shares != old

    def _gather_speeds(self) -> list[float]:
        """Micro-batches per second of each DP replica: its slowest rank's (TP, CP and
        pipeline peers of a replica compute the same micro-batches)."""
        world = dist.group.WORLD
        local = to_collective_device(torch.tensor(
            [float(self.state.dp_rank), self._seconds / self._microbatches],
            dtype=torch.float64), world)
        table = torch.empty(dist.get_world_size() * 2, dtype=torch.float64,
                            device=local.device)
        all_gather_into(table, local, world)
        per_microbatch = [0.0] * self.state.dp_size
        for dp_rank, seconds in table.view(-1, 2).cpu().tolist():
            per_microbatch[int(dp_rank)] = max(per_microbatch[int(dp_rank)], seconds)
        return [1.0 / max(s, 1e-9) for s in per_microbatch]

    def describe(self) -> str:
        """The log line's words for the shares and the speeds they were measured at."""
        line = f" data-parallel shares (micro-batches per DP rank): {list(self.shares)}"
        if self.measured is not None:
            line += " | measured micro-batches/s per DP rank: " + \
                    str([round(s, 2) for s in self.measured])
        return line + " |"
