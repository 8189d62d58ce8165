"""One executor for every schedule: run this rank's plan (p2p.py), its list of
(forward|backward|weight, microbatch, chunk) actions with, before each, the batch of sends
and receives that meets the neighbours' batches, and accumulate the loss on the last stage.
A schedule with weight actions splits each backward (weight_grad.py's B and W passes)."""

import contextlib
from typing import Callable

import torch

from megalite.timers import NO_TIMERS, Timers
from megalite.pipeline_parallel.p2p import PipelineCommunicator, RankPlan, action_messages
from megalite.pipeline_parallel.schedules import BACKWARD, FORWARD, WEIGHT
from megalite.tensor_parallel.weight_grad import LinearStep, WeightGradStore


def run_schedule(plan: RankPlan, chunks, microbatches: list[dict],
                 comm: PipelineCommunicator | None, loss_fn: Callable, backward_scale: Callable,
                 autocast: Callable, linear_step: LinearStep, forward_only: bool = False,
                 timers: Timers = NO_TIMERS,
                 before_backward: Callable | None = None) -> torch.Tensor:
    """Returns the sum of loss_fn(per-token losses, microbatch) over the microbatches (on
    the last pipeline stage; zero elsewhere). `backward_scale` maps that loss to what
    backward starts from (the fp16 loss scale). Without pipelining `comm` is None: the
    one stage is both first and last and the plan sends nothing. `linear_step`: the one
    installed on the chunks' layers (weight_grad.py), through which a split backward
    defers. `timers` times (and names for the profiler) the compute and the send/recv
    waits. `before_backward(microbatch, chunk)`, if given, runs before each backward
    (FSDP's gradient sync)."""
    split = any(a.kind == WEIGHT for a in plan.actions)
    # Without W passes no backward is split: torch's own linear node is cheaper.
    with contextlib.nullcontext() if split else linear_step.unsplit():
        return _run_actions(plan, chunks, microbatches, comm, loss_fn, backward_scale,
                            autocast, forward_only, timers, before_backward,
                            linear_step if split else None)


def _chunk_forward(chunk, stage, x, mb: dict, loss_fn: Callable, autocast: Callable):
    """One micro-batch through one chunk: its output, on the last stage its loss. Every stage
    reads the documents (--reset-attention-mask), the last the MTP targets
    (--mtp-num-layers)."""
    with autocast():
        mtp = ({"mtp_targets": (mb["mtp_labels"], mb["mtp_loss_mask"])}
               if stage.is_last and "mtp_labels" in mb else {})
        out = chunk(x, mb["labels"] if stage.is_last else None,
                    document_starts=mb.get("document_starts"), **mtp)
    return loss_fn(out, mb) if stage.is_last else out


def _run_actions(plan: RankPlan, chunks, microbatches: list[dict],
                 comm: PipelineCommunicator | None, loss_fn: Callable, backward_scale: Callable,
                 autocast: Callable, forward_only: bool, timers: Timers,
                 before_backward: Callable | None,
                 split: LinearStep | None) -> torch.Tensor:
    """`split`: the LinearStep through which each backward defers its weight gradients,
    None when no backward is split."""
    saved: dict[tuple[int, int], tuple] = {}
    deferred: dict[tuple[int, int], WeightGradStore] = {}  # B run, W not yet
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
                out = _chunk_forward(chunks[action.chunk], stage, x, mb, loss_fn, autocast)
            if stage.is_last:
                total += out.detach()
            else:
                outbox[sent] = out
            if not forward_only:
                saved[key] = (x, out)
        elif action.kind == BACKWARD:
            x, out = saved.pop(key)
            if before_backward is not None:
                before_backward(action.microbatch, action.chunk)
            context = contextlib.nullcontext()
            if split is not None:
                deferred[key] = WeightGradStore()
                context = split.defer_weight_grads(deferred[key])
            with timers("backward-compute"), context:
                if stage.is_last:
                    torch.autograd.backward(backward_scale(out))
                else:
                    torch.autograd.backward(out, inbox.pop(wanted))
            if sent is not None:
                outbox[sent] = x.grad
        else:
            with timers("weight-grad-compute"):
                deferred.pop(key).run()
    if comm is not None:
        with timers("pipeline-send-wait"):
            if plan.batches[-1]:
                comm.exchange(plan.batches[-1], outbox)
            comm.wait_all()
    return total
