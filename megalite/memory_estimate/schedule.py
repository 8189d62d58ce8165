"""The peak of a pipeline rank's activations: its chunks' bytes (activations.py) walked
through the action list its executor runs (`pipeline_parallel.schedules`), with the p2p
send buffers that the communication plan keeps."""

from itertools import accumulate

from megalite.config import Config
from megalite.memory_estimate.activations import Device, rank_chunks
from megalite.pipeline_parallel.p2p import communication_plan
from megalite.pipeline_parallel.schedules import BACKWARD, FORWARD, WEIGHT, build_schedule


def activation_bytes(config: Config, pp_rank: int, device: Device) -> tuple[int, int, int]:
    """(one micro-batch through every chunk of this rank, the peak over the step, the p2p
    buffers held at that peak). The peak walks this rank's schedule: a forward adds its
    chunk's saved tensors and its send buffer, a backward first rebuilds a recomputed
    group (working set), then frees the saved tensors and sends the input gradient.
    A send in a batch with a receive is let go once the batch is done (p2p.py), so the
    sent output lives until its backward (the executor keeps it for that; for a copy an
    upper bound) and the sent input gradient no longer than its backward; a send in a
    batch of sends only stays until the step ends (`sends_held`). Under a split backward
    (zb-h1) the saved tensors count until the micro-batch's W: an upper bound, as B frees
    all but the linear layers' inputs, which W keeps with their output gradients."""
    chunks = rank_chunks(config, pp_rank, device)
    par, m = config.parallel, config.training.num_microbatches
    schedule = build_schedule(par.pipeline_model_parallel_size, pp_rank, m, len(chunks),
                              par.pipeline_schedule)
    split = any(action.kind == WEIGHT for action in schedule)
    held = sends_held(config, pp_rank)
    live = sent = peak = peak_sent = 0
    until_backward = {}  # (microbatch, chunk) -> its sent output, let go at its backward
    for action, keep in zip(schedule, held):
        chunk, key = chunks[action.chunk], (action.microbatch, action.chunk)
        if action.kind == FORWARD:
            live += chunk.saved
            sent += chunk.send_forward
            until_backward[key] = 0 if keep else chunk.send_forward
            now = live + sent
        elif action.kind == WEIGHT:
            now = live + sent
            live -= chunk.saved
        else:
            now = live + sent + chunk.working_set
            live -= 0 if split else chunk.saved
            sent += (chunk.send_backward if keep else 0) - until_backward.pop(key)
        if now > peak:
            peak, peak_sent = now, sent
    fp8_weights = sum(chunk.fp8_weights for chunk in chunks)  # held through the whole walk
    return sum(chunk.saved for chunk in chunks), peak + fp8_weights, peak_sent


def sends_held(config: Config, pp_rank: int) -> list[bool]:
    """Per action of this rank's schedule, whether its send stays held until the step
    ends (p2p.RankPlan.sends_held, from every rank's plan); nothing is sent without PP."""
    par = config.parallel
    p, v = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    schedules = [build_schedule(p, r, config.training.num_microbatches, v,
                                par.pipeline_schedule) for r in range(p)]
    if p == 1:
        return [False] * len(schedules[0])
    return communication_plan(schedules, v)[pp_rank].sends_held()


def microbatches_in_flight(pp_size: int, pp_rank: int, num_microbatches: int,
                           num_chunks: int = 1, schedule: str = "1f1b") -> int:
    """Most (micro-batch, chunk) forwards whose backward (W, when split) has not run yet
    on this rank."""
    actions = build_schedule(pp_size, pp_rank, num_microbatches, num_chunks, schedule)
    done = WEIGHT if any(action.kind == WEIGHT for action in actions) else BACKWARD
    steps = (1 if action.kind == FORWARD else -1 if action.kind == done else 0
             for action in actions)
    return max(accumulate(steps, initial=0))
