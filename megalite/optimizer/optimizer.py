"""AdamW with the pieces Megatron wraps around it: weight-decay groups, fp16 loss-scale
unscaling with a skip on overflow, and global grad-norm clipping.

`Optimizer.step` is the one step skeleton (Megatron's `MixedPrecisionOptimizer.step`):
gather the fp32 gradients, unscale and check for overflow (fp16), grad norm, clip, AdamW,
copy the main parameters back into the model. Each stage is one fused or foreach kernel
over all gradients, never a Python loop of kernels per parameter. The plain optimizer steps
the model's fp32 parameters themselves; mixed_precision.py's keeps fp32 main copies.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import OptimizerConfig
from megalite.timers import NO_TIMERS, Timers
from megalite.parallel_state import all_reduce_anywhere, all_reduce_over, group_rank, group_size
from megalite.tensor_parallel.params import (is_embedding_copy, is_expert_parallel,
                                             is_tensor_parallel)


@dataclass
class Segment:
    """The part [start, end) of `param` (flattened) whose optimizer state this rank keeps.
    `main` is the fp32 tensor AdamW steps and keys its state by: the parameter itself in
    the plain optimizer, an fp32 main copy of the piece otherwise. Under ZeRO-1 the piece
    is elements [flat_start, flat_start + end - start) of bucket `bucket`'s flat buffers."""
    param: nn.Parameter
    start: int
    end: int
    main: torch.Tensor
    bucket: int = 0
    flat_start: int = 0

    @property
    def flat(self) -> slice:
        return slice(self.flat_start, self.flat_start + self.end - self.start)


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """No weight decay on biases and norm weights (1-D parameters): decaying a gain or an
    offset towards zero only fights the normalisation (Loshchilov & Hutter 2019)."""
    return name.endswith(".bias") or param.ndim == 1


def params_for_norm(params: list[torch.Tensor], tp_group) -> list[torch.Tensor]:
    """Each distinct parameter once across the model-parallel group: shards count on every
    rank, replicated parameters (norms, row-parallel biases) only on TP rank 0, and the
    last pipeline stage's copy of a tied embedding not at all."""
    first = group_rank(tp_group) == 0
    return [p for p in params if not is_embedding_copy(p) and (is_tensor_parallel(p) or first)]


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all `grads`, in fp32: one foreach kernel, no per-tensor loop."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()


def count_zeros(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Zero elements of all `tensors`, exactly, as an fp64 scalar."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([t.numel() - torch.count_nonzero(t) for t in tensors]).sum().double()


def squared_norm_over_experts(tensors: list[torch.Tensor], expert: list[bool],
                             expert_group, measure=squared_norm) -> torch.Tensor:
    """`measure` (squared_norm, or count_zeros) of `tensors`, the expert ones' part
    (`expert`) summed over the EP group `expert_group` first when it has several ranks
    (each holds other experts)."""
    if group_size(expert_group) <= 1:
        return measure(tensors)
    squares = measure([t for t, e in zip(tensors, expert) if not e])
    experts = measure([t for t, e in zip(tensors, expert) if e]).to(squares.device)
    all_reduce_anywhere(experts, expert_group)
    return squares + experts


def adamw_kernel(params: list[torch.Tensor]) -> dict:
    """torch's fused AdamW when every tensor is a CUDA or host float (fused on the CPU since
    torch 2.4: one pass over each tensor, where foreach makes about ten, each of them a
    parallel region on the CPU: 3.3 ms against 0.9 for nanoGPT's baby model on one
    thread, docs/benchmarks.md); else the foreach one. The two round differently."""
    if params and all(p.is_floating_point() and (p.is_cuda or p.is_cpu) for p in params):
        return {"fused": True}
    return {"foreach": True}


class Optimizer:
    """`model_parallel_group` holds every rank with a different piece of the same model
    replica: the grad norm and the overflow decision are agreed across it (and across DP
    when the state is sharded), so all ranks clip by the same factor and skip the same
    steps. Data-parallel gradients arrive already summed (megalite/distributed/grad_buffer.py).
    `expert_group` (EP; None without expert parallelism) holds the ranks with the other
    experts of each MoE layer: the experts' share of the norm is summed over it.
    """

    sharded = False
    """Whether each DP rank keeps only its shard of the optimizer state (ZeRO-1)."""

    def __init__(self, model: nn.Module, config: OptimizerConfig, grad_scaler=None,
                 tp_group=None, model_parallel_group=None, timers: Timers = NO_TIMERS,
                 expert_group=None):
        self.config, self.timers, self.expert_group = config, timers, expert_group
        self.grad_scaler, self.model_parallel_group = grad_scaler, model_parallel_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.segments = self._owned_segments()
        counted = {id(p) for p in params_for_norm(self.params, tp_group)}
        self._norm_segments = [s for s in self.segments if id(s.param) in counted]
        no_decay = {id(p) for n, p in model.named_parameters() if no_weight_decay(n, p)}
        self.adam = torch.optim.AdamW(
            [{"params": [s.main for s in self.segments if id(s.param) not in no_decay],
              "weight_decay": config.weight_decay},
             {"params": [s.main for s in self.segments if id(s.param) in no_decay],
              "weight_decay": 0.0}],
            lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
            **adamw_kernel([s.main for s in self.segments]))

    def _owned_segments(self) -> list[Segment]:
        return [Segment(p, 0, p.numel(), p) for p in self.params]

    @property
    def param_groups(self):
        return self.adam.param_groups

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def _reduce_groups(self) -> list:
        """The groups whose ranks hold different gradients of one model replica."""
        return [self.model_parallel_group]

    def _expert_reduce_group(self):
        """Where the experts' gradients differ beyond `_reduce_groups`: the EP group."""
        return self.expert_group

    def _measure_grads(self, measure=squared_norm) -> torch.Tensor:
        """This rank's share over `_reduce_groups` of `measure` of the gradients the norm
        counts: the experts' part summed over EP first (each expert counted once, on the
        rank holding it)."""
        segments = [s for s in self._norm_segments if s.main.grad is not None]
        return squared_norm_over_experts([s.main.grad for s in segments],
                                         [is_expert_parallel(s.param) for s in segments],
                                         self._expert_reduce_group(), measure)

    def optimizer_state_bytes(self) -> int:
        """Bytes of the main parameters this rank's optimizer steps (fp32 copies or shards;
        the parameters themselves for plain fp32 AdamW) and of their Adam moments."""
        return sum(t.numel() * t.element_size() for s in self.segments
                   for t in [s.main, *self.adam.state.get(s.main, {}).values()]
                   if torch.is_tensor(t) and t.dim() > 0)

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        for s in self.segments:
            s.main.grad = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale

    def _load_main_grads(self):
        """Point each main tensor's .grad at its fp32 gradient: here the parameters' own."""

    def _copy_main_to_params(self):
        """Nothing to copy: AdamW updated the parameters in place."""

    @torch.no_grad()
    def step(self, before_update=None) -> tuple[bool, float | None]:
        """Returns (update applied, grad norm). An fp16 overflow skips the update.
        `before_update(squares)`, if given, sees this rank's share of the squared grad norm
        before any parameter changes (a non-finite one means a NaN or inf gradient here)."""
        self._load_main_grads()
        grads = [s.main.grad for s in self.segments if s.main.grad is not None]
        if self.grad_scaler is not None:
            with self.timers("optimizer-unscale-and-check-inf"):
                overflow = self._unscale_and_check_inf(grads)
            if overflow:
                self.zero_grad()
                return False, None
        with self.timers("optimizer-clip-main-grad"):
            squares = self._measure_grads()
            if before_update is not None:
                before_update(squares)
            with self.timers("grad-norm-all-reduce"):
                # On the host in the host step of --optimizer-cpu-offload, which
                # all_reduce_anywhere takes over NCCL too. A copy: `before_update` kept it.
                squares = squares.clone()
                # Each rank's squares are disjoint: DP shards, TP pieces.
                all_reduce_over(squares, self._reduce_groups())
                grad_norm = squares.sqrt().item()
            # Megatron's rule: scale by max_norm / (norm + 1e-6) only when that is below 1.
            coeff = self.config.clip_grad / (grad_norm + 1.0e-6)
            if self.config.clip_grad > 0 and coeff < 1.0:
                torch._foreach_mul_(grads, coeff)
        with self.timers("optimizer-inner-step"):
            self.adam.step()
        with self.timers("optimizer-copy-main-to-model-params"):
            self._copy_main_to_params()
        return True, grad_norm

    def _unscale_and_check_inf(self, grads: list[torch.Tensor]) -> bool:
        """fp16: divide the gradients by the loss scale; whether any rank overflowed."""
        found_inf = torch.zeros((), device=grads[0].device if grads else "cpu")
        inv_scale = torch.full((), 1.0 / self.grad_scaler.scale, device=found_inf.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        # The max over DP shards and model-parallel pieces.
        all_reduce_over(found_inf, [*self._reduce_groups(), self._expert_reduce_group()],
                        dist.ReduceOp.MAX)
        overflow = bool(found_inf.item())
        self.grad_scaler.update(overflow)
        return overflow

    @torch.no_grad()
    def num_zeros_in_grad(self) -> int | None:
        """Zero elements in the gradients of the last update (Megatron's
        --log-num-zeros-in-grad), each distinct parameter counted once, as the grad norm
        counts them; None after a skipped step. A collective over the reduce groups."""
        if all(s.main.grad is None for s in self.segments):
            return None
        zeros = self._measure_grads(count_zeros)
        all_reduce_over(zeros, self._reduce_groups())  # counted on the host under offload
        return int(zeros.item())

    def finish_param_gather(self):
        """Nothing in flight: the parameters are updated in place by step()."""

    def reload_main_params(self):
        """Nothing to reload after a model-only load: the parameters are the main copy."""

    @torch.no_grad()
    def restore_state(self, segment: Segment, step: int, moments: dict[str, torch.Tensor]):
        """AdamW's state of `segment` from a checkpoint, where torch's AdamW keeps it: the
        moments with the main tensor (device and dtype), the step count on the host
        unless the kernel is fused (torch's `_process_value_according_to_param_policy`)."""
        main = segment.main
        fused = self.adam.defaults.get("fused")
        self.adam.state[main] = {
            "step": torch.tensor(float(step), dtype=torch.float32,
                                 device=main.device if fused else "cpu"),
            **{k: v.reshape(main.shape).to(main.device, main.dtype, copy=True)
               for k, v in moments.items()}}
