"""One executor for every schedule: run this rank's plan (p2p.py), its list of
(forward|backward, microbatch, chunk) actions with, before each, the batch of sends and
receives that meets the neighbours' batches, and accumulate the loss on the last stage."""

from typing import Callable

import torch

from megalite.monitoring.timers import NO_TIMERS, Timers
from megalite.pipeline_parallel.p2p import PipelineCommunicator, RankPlan, action_messages
from megalite.pipeline_parallel.schedules import FORWARD


def run_schedule(plan: RankPlan, chunks, microbatches: list[dict],
                 comm: PipelineCommunicator | None, loss_fn: Callable, backward_scale: Callable,
                 autocast: Callable, forward_only: bool = False,
                 timers: Timers = NO_TIMERS) -> torch.Tensor:
    """Returns the sum of loss_fn(per-token losses, microbatch) over the microbatches (on
    the last pipeline stage; zero elsewhere). `backward_scale` maps that loss to what
    backward starts from (the fp16 loss scale). Without pipelining `comm` is None: the
    one stage is both first and last and the plan sends nothing. `timers` times (and
    names for the profiler) the compute and the send/recv waits."""
    saved: dict[tuple[int, int], tuple] = {}
    inbox, outbox = {}, {}  # received and not yet used; computed and not yet sent
    total = torch.zeros((), device=microbatches[0]["tokens"].device)
    for action, batch in zip(plan.actions, plan.batches):
        if batch:
            with timers("pipeline-send-recv"):
                inbox.update(comm.exchange(batch, outbox))
        key = (action.microbatch, action.chunk)
        stage = plan.stages[action.chunk]
        wanted, sent = action_messages(action, stage)
        mb = microbatches[action.microbatch]
        if action.kind == FORWARD:
            x = mb["tokens"] if wanted is None else inbox.pop(wanted)
            if wanted is not None and not forward_only:
                x.requires_grad_()
            with timers("forward-compute"):
                with autocast():
                    out = chunks[action.chunk](x, mb["labels"] if stage.is_last else None)
                if stage.is_last:
                    out = loss_fn(out, mb)
            if stage.is_last:
                total += out.detach()
            else:
                outbox[sent] = out
            if not forward_only:
                saved[key] = (x, out)
        else:
            x, out = saved.pop(key)
            with timers("backward-compute"):
                if stage.is_last:
                    torch.autograd.backward(backward_scale(out))
                else:
                    torch.autograd.backward(out, inbox.pop(wanted))
            if sent is not None:
                outbox[sent] = x.grad
    if comm is not None:
        with timers("pipeline-send-wait"):
            if plan.batches[-1]:
                comm.exchange(plan.batches[-1], outbox)
            comm.wait_all()
    return total
