"""One training step and one evaluation pass over a global batch, for any layout.

A step runs this rank's pipeline schedule over its micro-batches (plain gradient
accumulation without pipelining), finalises the gradients (the all-reduces that make
every parameter's gradient the sum over all the places it was used), and takes one
optimizer step. The loss is the token-weighted mean over the global batch (docs/design.md §3):
each micro-batch's summed token losses are divided by the global batch's loss-token
count, so the split into micro-batches and stages cannot change it.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import Config, PrecisionConfig
from megalite.distributed.fsdp import is_fully_sharded, set_gradient_sync
from megalite.distributed.grad_buffer import GradBuffer
from megalite.errors import NumericalError
from megalite.timers import NO_TIMERS, Timers
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import (ParallelState, all_gather_first_dim, all_reduce_anywhere,
                                     group_size, num_microbatches)
from megalite.pipeline_parallel.executor import run_schedule
from megalite.pipeline_parallel.p2p import PipelineCommunicator, communication_plan
from megalite.pipeline_parallel.schedules import build_schedule, forward_only
from megalite.model.gpt import activation_shape
from megalite.model.moe import set_aux_loss_scale, update_expert_bias
from megalite.model.mtp import set_mtp_loss_weights, take_mtp_loss_sums
from megalite.tensor_parallel.fp8 import quantize_weights_once
from megalite.tensor_parallel.layers import allreduce_sequence_parallel_grads
from megalite.tensor_parallel.params import is_shared_embedding, main_grad
from megalite.tensor_parallel.weight_grad import LinearStep


def autocast(precision: PrecisionConfig, device: torch.device):
    """bf16/fp16 autocast on whichever device we run; a no-op in fp32. The parameters are
    already half precision then; autocast keeps the numerically delicate ops (norms,
    softmax) in fp32."""
    if precision.params_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.params_dtype)


@dataclass
class StepResult:
    loss: float
    """The global batch's loss (on the last pipeline stage; 0.0 on the others)."""
    skipped: bool
    grad_norm: float | None
    mtp_losses: list[float] | None = None
    """Each MTP depth's loss (its token-weighted mean over the global batch, unscaled), on
    the last pipeline stage; None without --mtp-num-layers."""


def loss_token_counts(microbatches: list[dict], mtp_depths: int) -> torch.Tensor:
    """[1 + D]: the micro-batches' loss tokens, of the lm loss and of each MTP depth."""
    counts = [mb["loss_mask"].sum() for mb in microbatches]
    if mtp_depths:
        counts = [torch.cat([c.view(1), mb["mtp_loss_mask"].sum(dim=(0, 1))])
                  for c, mb in zip(counts, microbatches)]
    return torch.stack(counts).sum(dim=0).reshape(1 + mtp_depths)


class StepRunner:
    """Runs steps of `chunks` (this rank's model chunks) with `optimizer`, as `config` says:
    its precision, micro-batches, --pipeline-schedule (schedules.SCHEDULES), NaN check, and
    whether FSDP2 chunks reduce-scatter their gradients in the last micro-batch's backward
    or in every one (--fsdp-grad-reduce-every-micro-batch).

    `state`'s tensor group reduces sequence-parallel grads, its pipeline group carries
    activations, its embedding group sums the grads of tied embeddings split across the
    first and last stage, and its data x context group sums the losses of the ranks' slices
    of the global batch (a DP rank's samples, a CP rank's chunks of them); a single process
    passes `ParallelState.single_process()`. `grad_buffer` holds the gradients and sums
    them over the data x context group (needed when DP x CP > 1). `timers` times the step's
    phases (timers.py).

    The runner owns what the chunks' linear layers share within a step, `linear_step`
    (weight_grad.LinearStep: the split backward's B-pass store, the FP8 weight copies), and
    installs it on them and on the gradient buffer: nothing of it is module-level, so two
    models in one process keep their own.
    """

    def __init__(self, chunks: nn.ModuleList, optimizer: Optimizer, config: Config,
                 state: ParallelState, device: torch.device,
                 grad_buffer: GradBuffer | None = None, timers: Timers = NO_TIMERS):
        self.chunks, self.optimizer, self.precision = chunks, optimizer, config.precision
        self.state, self.device, self.grad_buffer, self.timers = state, device, grad_buffer, timers
        self.linear_step = LinearStep()
        self.linear_step.install(chunks)
        # fp16's loss scaler skips the steps whose gradients overflow instead.
        self.check_for_nan = config.checkpoint.check_for_nan and not config.precision.fp16
        if grad_buffer is not None:
            grad_buffer.linear_step = self.linear_step
            grad_buffer.check_finite = self.check_for_nan
        fsdp = is_fully_sharded(chunks)
        self.fsdp_defer_grad_reduce = (fsdp and
                                       not config.parallel.fsdp_grad_reduce_every_micro_batch)
        if grad_buffer is None and state.dp_cp_size > 1 and not fsdp:
            raise ValueError("data and context parallelism need a GradBuffer (or FSDP) to "
                             "reduce the gradients")
        self.pipeline_schedule = config.parallel.pipeline_schedule
        self.mtp_depths = config.model.mtp_depths
        self.mtp_scaling = config.model.mtp_loss_scaling_factor
        # Each micro-batch's MoE auxiliary losses weigh 1 / (micro-batches per global
        # batch), a number DP does not change (model/moe.py).
        self.microbatches_per_global_batch = num_microbatches(
            config.training.global_batch_size, config.training.micro_batch_size)
        self._plan(config.training.num_microbatches)
        self.comm = None
        if state.pp_size > 1:
            # Activations travel in the compute dtype (under FSDP2 the gathered
            # parameters', not the fp32 shards').
            shape = activation_shape(config.model, config.training.micro_batch_size,
                                     state.tp_size, state.cp_size)
            self.comm = PipelineCommunicator(state, shape, self.precision.params_dtype, device)

    def _plan(self, m: int):
        """This rank's schedules for m micro-batches. Each rank's p2p batches are paired
        with its neighbours', so plan from every rank's list. Uneven data-parallel shares
        (data/shares.py) give DP replicas, and so a step, other counts."""
        pp, v, rank = self.state.pp_size, len(self.chunks), self.state.pp_rank
        self.num_microbatches = m
        self.schedule = communication_plan(
            [build_schedule(pp, r, m, v, self.pipeline_schedule) for r in range(pp)], v)[rank]
        self.eval_schedule = communication_plan(
            [forward_only(pp, r, m, v) for r in range(pp)], v)[rank]

    def _autocast(self):
        return autocast(self.precision, self.device)

    def train_step(self, microbatches: list[dict]) -> StepResult:
        # Loss tokens of the whole global batch: every DP and CP rank divides by the same
        # count.
        timers = self.timers
        if len(microbatches) != self.num_microbatches:
            self._plan(len(microbatches))
        with timers("loss-all-reduce"):
            counts = self._sum_over_data_parallel(loss_token_counts(microbatches, self.mtp_depths))
        num_tokens, mtp_tokens = counts[0], counts[1:].clamp(min=1)
        if self.mtp_depths:
            set_mtp_loss_weights(self.chunks, self.optimizer.loss_scale * self.mtp_scaling
                                 / self.mtp_depths / mtp_tokens)
        if self.grad_buffer is not None:
            self.grad_buffer.start_step(self.num_microbatches)
        else:
            self.optimizer.zero_grad()
        set_aux_loss_scale(self.chunks,
                           self.optimizer.loss_scale / self.microbatches_per_global_batch)
        with timers("forward-backward"), quantize_weights_once(self.linear_step):
            loss = run_schedule(self.schedule, self.chunks, microbatches, self.comm,
                                lambda losses, mb: (losses * mb["loss_mask"]).sum() / num_tokens,
                                self.optimizer.scale_loss, self._autocast, self.linear_step,
                                timers=timers,
                                before_backward=self._before_backward
                                if self.fsdp_defer_grad_reduce else None)
        with timers("all-grads-sync"):
            self.finalize_grads()
        check = (lambda squares: self._stop_on_nonfinite(loss, squares)) \
            if self.check_for_nan else None
        with timers("optimizer"):
            updated, grad_norm = self.optimizer.step(before_update=check)
        with timers("loss-all-reduce"):
            # One all-reduce for the lm loss and the MTP losses' sums.
            sums = self._sum_over_data_parallel(torch.cat([
                loss.view(1), take_mtp_loss_sums(self.chunks, self.mtp_depths, loss.device)]))
        mtp_losses = (sums[1:] / mtp_tokens.to(sums.device)).tolist() if self.mtp_depths else None
        return StepResult(sums[0].item(), not updated, grad_norm, mtp_losses)

    def _before_backward(self, microbatch: int, chunk: int):
        # FSDP2 reduce-scatters a chunk's gradients only in its last micro-batch's
        # backward (every schedule runs a chunk's backwards in micro-batch order).
        set_gradient_sync(self.chunks[chunk], microbatch == self.num_microbatches - 1)

    def _stop_on_nonfinite(self, loss: torch.Tensor, squares: torch.Tensor):
        """Inside the optimizer step, before any parameter changes, so a NaN never reaches
        the weights: every rank learns which ranks saw a non-finite loss, a non-finite
        gradient of their own before the data-parallel reduction (the grad buffer's note:
        after it an all-reduce spreads a NaN to every rank, ZeRO-1's reduce-scatter to the
        shard's owner) or a non-finite reduced gradient, and all raise naming the first:
        where the NaN starts. Reduced gradients are judged by this rank's share of the
        squared grad norm, computed anyway (Megatron checks the norm likewise)."""
        own = getattr(self.grad_buffer, "local_nonfinite", None)
        local = torch.stack([~torch.isfinite(loss).all(),
                             own.to(loss.device) if own is not None else torch.tensor(
                                 False, device=loss.device),
                             ~torch.isfinite(squares.to(loss.device))]).float()
        flags = local[None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            flags = all_gather_first_dim(flags, dist.group.WORLD)
        for column, what, when in ((0, "lm loss", ""),
                                   (1, "a gradient", " before the data-parallel reduction"),
                                   (2, "a gradient", "")):
            ranks = flags[:, column].nonzero().view(-1).tolist()
            if ranks:
                raise NumericalError(f"{what} is NaN or infinite on rank(s) {ranks}{when}; "
                                     "stopped before the optimizer step")

    def _sum_over_data_parallel(self, value: torch.Tensor) -> torch.Tensor:
        """Summed over DP x CP: the ranks holding other samples or other chunks of them."""
        if self.state.dp_cp_size == 1:
            return value
        value = value.clone()
        dist.all_reduce(value, group=self.state.dp_cp_group)
        return value

    def finalize_grads(self):
        """Make every gradient the sum over all the places its parameter was used. The
        three reductions are sums over different groups, so their order does not matter;
        under ZeRO-1 the last two act on whole gradients of which only this rank's shard
        is summed over DP, which is all its optimizer reads (the shards of TP peers, and
        of a tied embedding's two copies, sit at the same buffer offsets)."""
        # PowerSGD is not linear: a tied embedding's two uses are summed before it
        # compresses them, as one process compresses their sum.
        compressing = self.grad_buffer is not None and self.grad_buffer.compressing
        if compressing:
            self._sum_tied_embeddings()
        if self.grad_buffer is not None:
            self.grad_buffer.finish()
        # Under SP, norms and row-parallel biases saw only this rank's sequence shard.
        if self.state.tp_size > 1:
            with self.timers("layernorm-grads-all-reduce"):
                allreduce_sequence_parallel_grads(self.optimizer.params, self.state.tp_group)
        if not compressing:
            self._sum_tied_embeddings()
        # As Megatron, in the gradient finalisation: the next forward routes with it.
        update_expert_bias(self.chunks, self.state.dp_cp_group)

    def _sum_tied_embeddings(self):
        group = self.state.embedding_group
        if self.state.pp_size > 1 and group is not None and group_size(group) > 1:
            # A tied embedding is used on the first stage (input) and the last (output):
            # its gradient is the sum of both uses.
            with self.timers("embedding-grads-all-reduce"):
                for p in self.optimizer.params:
                    grad = main_grad(p)
                    if is_shared_embedding(p) and grad is not None:
                        all_reduce_anywhere(grad, group)

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict]) -> tuple[float, float]:
        """(sum of token losses, number of loss tokens) over the micro-batches."""
        if len(microbatches) != self.num_microbatches:
            self._plan(len(microbatches))
        self.chunks.eval()
        # Untimed (timers=NO_TIMERS): the timers report training steps only.
        loss_sum = run_schedule(self.eval_schedule, self.chunks, microbatches, self.comm,
                                lambda losses, mb: (losses * mb["loss_mask"]).sum(),
                                lambda loss: loss, self._autocast, self.linear_step,
                                forward_only=True)
        self.chunks.train()
        tokens = sum(mb["loss_mask"].sum() for mb in microbatches)
        return (self._sum_over_data_parallel(loss_sum).item(),
                self._sum_over_data_parallel(tokens).item())
