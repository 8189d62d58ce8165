"""One executor for every schedule: run this rank's list of (forward|backward,
microbatch, chunk) actions, receiving inputs from the previous stage and sending outputs
to the next, and accumulate the loss on the last stage."""

from typing import Callable

import torch

from megalite.pipeline_parallel.p2p import PipelineCommunicator
from megalite.pipeline_parallel.schedules import Action


def run_schedule(actions: list[Action], chunks, microbatches: list[dict],
                 comm: PipelineCommunicator | None, loss_fn: Callable, backward_scale: Callable,
                 autocast: Callable, forward_only: bool = False) -> torch.Tensor:
    """Returns the sum of loss_fn(per-token losses, microbatch) over the microbatches (on
    the last pipeline stage; zero elsewhere). `backward_scale` maps that loss to what
    backward starts from (the fp16 loss scale). Without pipelining `comm` is None: the
    one stage is both first and last and nothing is sent."""
    num_stages = comm.pp_size * comm.num_chunks if comm is not None else 1
    saved: dict[tuple[int, int], tuple] = {}
    total = torch.zeros((), device=microbatches[0]["tokens"].device)
    for action in actions:
        key = (action.microbatch, action.chunk)
        stage = comm.stage(action.chunk) if comm is not None else 0
        first, last = stage == 0, stage == num_stages - 1
        batch = microbatches[action.microbatch]
        if action.kind == "forward":
            x = batch["tokens"] if first else comm.recv_forward(*key)
            if not first and not forward_only:
                x.requires_grad_()
            with autocast():
                out = chunks[action.chunk](x, batch["labels"] if last else None)
            if last:
                out = loss_fn(out, batch)
                total += out.detach()
            else:
                comm.send_forward(out, *key)
            if not forward_only:
                saved[key] = (x, out)
        else:
            x, out = saved.pop(key)
            if last:
                torch.autograd.backward(backward_scale(out))
            else:
                torch.autograd.backward(out, comm.recv_backward(*key))
            if not first:
                comm.send_backward(x.grad, *key)
    if comm is not None:
        comm.wait_all()
    return total
