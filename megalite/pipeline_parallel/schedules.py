"""Pipeline schedules as pure functions (docs/design.md §5; Narayanan et al. 2021, §2.2;
GPipe, Huang et al. 2019; zero bubble, Qi et al. 2024).

A schedule is this rank's ordered list of `Action`s: forward, backward or weight-gradient
pass of one microbatch through one model chunk. A schedule that lists WEIGHT actions splits
each backward in two (Qi et al. §2; weight_grad.py): BACKWARD computes only the input
gradient (B), which the previous stage waits for, and that microbatch's WEIGHT (W) later the
weight gradients. Without WEIGHT actions BACKWARD is the whole backward. Nothing here
communicates: p2p.py pairs the sends and receives the actions imply, the executor runs them,
and simulate.py runs all ranks' lists together (deadlocks, bubble), on the placement of
stages.py (chunk c of rank r is global stage c*p + r).
"""

from dataclasses import dataclass

from megalite.errors import ConfigError

FORWARD = "forward"
BACKWARD = "backward"
WEIGHT = "weight"

# --pipeline-schedule choices. "1f1b" is interleaved when there are several model chunks.
SCHEDULES = ("1f1b", "gpipe", "zb-h1")


@dataclass(frozen=True)
class Action:
    kind: str        # FORWARD, BACKWARD or WEIGHT
    microbatch: int  # 0..m-1
    chunk: int       # model chunk (virtual stage) 0..v-1 on this rank


def validate_schedule_args(pp_size: int, num_microbatches: int, num_chunks: int = 1,
                           schedule: str = "1f1b", pp_rank: int | None = None) -> None:
    """Raise ConfigError, naming the flags, for (p, m, v) no schedule here can run, and
    ValueError for a `pp_rank` outside the pipeline."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, "
                          f"got {schedule!r}")
    if schedule != "1f1b" and num_chunks > 1:
        # GPipe and ZB-H1 are defined, and built here, for one chunk per rank; the zero
        # bubble paper's interleaved form (ZB-V) is a different schedule, not built.
        raise ConfigError(f"--pipeline-schedule {schedule} runs one model chunk per pipeline "
                          f"rank; it cannot be combined with "
                          f"--num-layers-per-virtual-pipeline-stage (got {num_chunks} chunks "
                          f"per rank); use --pipeline-schedule 1f1b to interleave")
    if pp_size < 1:
        raise ConfigError(f"--pipeline-model-parallel-size must be >= 1, got {pp_size}")
    if num_microbatches < 1:
        raise ConfigError(
            f"--global-batch-size / (--micro-batch-size x DP) = m must be >= 1 microbatch, "
            f"got m={num_microbatches}")
    if num_chunks < 1:
        raise ConfigError(f"the number of model chunks per pipeline rank (set by "
                          f"--num-layers-per-virtual-pipeline-stage) must be >= 1, "
                          f"got {num_chunks}")
    if num_chunks > 1 and pp_size == 1:
        raise ConfigError(
            f"--num-layers-per-virtual-pipeline-stage gives {num_chunks} model chunks per "
            f"rank, which interleaves a pipeline; it needs --pipeline-model-parallel-size "
            f"> 1, got 1")
    # The interleaved schedule cycles through the chunks in groups of p microbatches, so a
    # partial last group would leave chunks without a full round of microbatches.
    if num_chunks > 1 and num_microbatches % pp_size != 0:
        raise ConfigError(
            f"the interleaved schedule (--num-layers-per-virtual-pipeline-stage) runs "
            f"microbatches in groups of --pipeline-model-parallel-size: "
            f"--global-batch-size / (--micro-batch-size x DP) = m must be a multiple of "
            f"--pipeline-model-parallel-size; got m={num_microbatches}, "
            f"--pipeline-model-parallel-size={pp_size}")
    if pp_rank is not None and not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside 0..{pp_size - 1}")


def no_pipelining(num_microbatches: int) -> list[Action]:
    """Gradient accumulation on one stage: F0 B0 F1 B1 ... (one activation set alive)."""
    validate_schedule_args(1, num_microbatches, 1)
    return [Action(kind, i, 0) for i in range(num_microbatches) for kind in (FORWARD, BACKWARD)]


def warmup_microbatches(pp_size: int, pp_rank: int, num_microbatches: int,
                        num_chunks: int = 1) -> int:
    """Forwards this rank runs before its first 1F1B pair.

    1F1B: rank r must fill the p-r-1 stages after it before the first backward can come
    back, so it runs min(p-r-1, m) forwards (paper §2.2, Fig. 4 top).
    Interleaved: the first backward reaches rank r only after microbatches 0..p-1 have
    gone through all v chunks ((v-1)*p extra forwards) and back from the last rank
    (2*(p-r-1)), capped at m*v. With m == p there is no steady state worth having, so all
    forwards run first, as in Megatron.
    """
    validate_schedule_args(pp_size, num_microbatches, num_chunks, pp_rank=pp_rank)
    if num_chunks == 1:
        return min(pp_size - pp_rank - 1, num_microbatches)
    total = num_microbatches * num_chunks
    if num_microbatches == pp_size:
        return total
    return min(2 * (pp_size - pp_rank - 1) + (num_chunks - 1) * pp_size, total)


def one_f_one_b(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """PipeDream-Flush 1F1B (paper §2.2): at most p-r microbatches in flight on rank r.

        warmup    F0 F1 .. F(w-1)                  w = min(p-r-1, m)
        steady    F(w) B0  F(w+1) B1 ..  F(m-1) B(m-1-w)
        cooldown  B(m-w) .. B(m-1)
    """
    return interleaved_one_f_one_b(pp_size, pp_rank, num_microbatches, 1)


def interleaved_one_f_one_b(pp_size: int, pp_rank: int, num_microbatches: int,
                            num_chunks: int) -> list[Action]:
    """Interleaved 1F1B (paper §2.2, Fig. 4 bottom) over n = m*v virtual microbatches.

    Virtual microbatch k runs microbatch `microbatch(k)` on chunk `chunk(k)`: chunks in
    increasing order for forwards, decreasing for backwards, p microbatches at a time. With
    v = 1 this is exactly 1F1B.

        warmup    F(0) .. F(w-1)                   w = warmup_microbatches(...)
        steady    F(w) B(0)  F(w+1) B(1) ..  F(n-1) B(n-1-w)
        cooldown  B(n-w) .. B(n-1)
    """
    p, v = pp_size, num_chunks
    warmup = warmup_microbatches(p, pp_rank, num_microbatches, v)
    total = num_microbatches * v

    def microbatch(k):
        return (k // (p * v)) * p + k % p

    def chunk(k):
        # Virtual microbatches come in groups of p*v: p microbatches on chunk 0, then the
        # same p on chunk 1, ... so each chunk's output is ready when the next asks for it.
        return (k // p) % v

    forwards = [Action(FORWARD, microbatch(k), chunk(k)) for k in range(total)]
    backwards = [Action(BACKWARD, microbatch(k), v - 1 - chunk(k)) for k in range(total)]
    steady = [a for pair in zip(forwards[warmup:], backwards) for a in pair]
    return forwards[:warmup] + steady + backwards[total - warmup:]


def gpipe(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """GPipe (Huang et al. 2019): every forward, then every backward, in microbatch order.

        F0 F1 .. F(m-1)  B0 B1 .. B(m-1)

    Same bubble as 1F1B, (p-1)/m, but all m microbatches' activations are alive at once.
    """
    validate_schedule_args(pp_size, num_microbatches, 1, "gpipe", pp_rank)
    return ([Action(FORWARD, i, 0) for i in range(num_microbatches)] +
            [Action(BACKWARD, i, 0) for i in range(num_microbatches)])


def zb_h1(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024, §3.1, Fig. 3): 1F1B's order of forwards and backwards, each
    backward split into B (input gradient) and W (weight gradient). Rank r defers its
    first r W passes: while 1F1B's later ranks would wait for the next forward, they
    run an older microbatch's W instead, and the deferred Ws fill the cooldown, where
    1F1B idles. A microbatch stays in flight from its F to its W, so rank r holds at most
    p-r (1F1B) + r = p microbatches: rank 0, which defers none, as many as in 1F1B.

        warmup    F0 .. F(w-1)                           w = min(p-r-1, m)
        steady    F(w+k) B(k) [W(k-r)]   for k = 0 .. m-w-1
        cooldown  B(k) [W(k-r)]          for k = m-w .. m-1,   then the remaining Ws

    With F, B, W the times of the three passes and W <= F, W <= B, the bubble is
    (p-1)(F+B-W) / (m(F+B+W)): a third of 1F1B's (p-1)/m when F = B = W.
    """
    validate_schedule_args(pp_size, num_microbatches, 1, "zb-h1", pp_rank)
    actions, weights = [], 0
    for action in one_f_one_b(pp_size, pp_rank, num_microbatches):
        actions.append(action)
        if action.kind == BACKWARD and action.microbatch >= pp_rank:
            actions.append(Action(WEIGHT, weights, 0))
            weights += 1
    return actions + [Action(WEIGHT, i, 0) for i in range(weights, num_microbatches)]


def forward_only(pp_size: int, pp_rank: int, num_microbatches: int,
                 num_chunks: int = 1) -> list[Action]:
    """Evaluation: every forward, in the order training runs them (no activations kept)."""
    schedule = build_schedule(pp_size, pp_rank, num_microbatches, num_chunks)
    return [a for a in schedule if a.kind == FORWARD]


def build_schedule(pp_size: int, pp_rank: int, num_microbatches: int,
                   num_chunks: int = 1, schedule: str = "1f1b") -> list[Action]:
    """The training schedule for this (p, m, v) and --pipeline-schedule: accumulation,
    1F1B or interleaved 1F1B, GPipe, ZB-H1. Without pipelining every schedule is
    gradient accumulation (no bubble to fill, so no backward is split)."""
    validate_schedule_args(pp_size, num_microbatches, num_chunks, schedule, pp_rank)
    if pp_size == 1:
        return no_pipelining(num_microbatches)
    if schedule == "gpipe":
        return gpipe(pp_size, pp_rank, num_microbatches)
    if schedule == "zb-h1":
        return zb_h1(pp_size, pp_rank, num_microbatches)
    if num_chunks == 1:
        return one_f_one_b(pp_size, pp_rank, num_microbatches)
    return interleaved_one_f_one_b(pp_size, pp_rank, num_microbatches, num_chunks)
