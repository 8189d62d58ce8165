"""AdamW with the pieces Megatron wraps around it: weight-decay groups, fp16 loss-scale
unscaling with a skip on overflow, and global grad-norm clipping."""

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import OptimizerConfig
from megalite.parallel_state import group_rank, group_size


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """No weight decay on biases and norm weights (1-D parameters): decaying a gain or an
    offset towards zero only fights the normalisation (Loshchilov & Hutter 2019)."""
    return name.endswith(".bias") or param.ndim == 1


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if no_weight_decay(name, param) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def params_for_norm(params: list[torch.Tensor], tp_group) -> list[torch.Tensor]:
    """Each distinct parameter once across the model-parallel group: shards count on every
    rank, replicated parameters (norms, row-parallel biases) only on TP rank 0, and the
    last pipeline stage's copy of a tied embedding not at all."""
    first = group_rank(tp_group) == 0
    return [p for p in params if not getattr(p, "embedding_copy", False)
            and (getattr(p, "tensor_model_parallel", False) or first)]


@torch.no_grad()
def global_grad_norm(grads: list[torch.Tensor], groups=()) -> torch.Tensor:
    """L2 norm of all gradients together, accumulated in fp32, summed over every rank of
    `groups` (each rank passes its own gradients, each counted once)."""
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        squares += torch.linalg.vector_norm(g.float()) ** 2
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(squares, group=group)
    return squares.sqrt()


@torch.no_grad()
def found_nonfinite(grads: list[torch.Tensor], group=None) -> bool:
    """Whether any gradient on any rank of `group` (None: this rank alone) holds an inf or
    NaN, so that every rank of the group skips the same fp16 overflow step."""
    device = grads[0].device if grads else torch.device("cpu")
    flag = torch.zeros((), device=device)
    for g in grads:
        flag = torch.maximum(flag, (~torch.isfinite(g)).any().float())
    if group_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


@torch.no_grad()
def clip_grads(params: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor):
    """Megatron's rule: scale by max_norm / (norm + 1e-6) only when that is below 1."""
    coeff = max_norm / (total_norm.item() + 1.0e-6)
    if coeff < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coeff)


class Optimizer:
    """One optimizer step: unscale (fp16), check for overflow, clip, AdamW.

    `model_parallel_group` holds every rank with a different piece of the same model
    replica: the grad norm and the overflow decision are agreed across it, so all its
    ranks clip by the same factor and skip the same steps. Data-parallel gradients arrive
    already summed in .grad (megalite/distributed/grad_buffer.py).
    """

    def __init__(self, model: nn.Module, config: OptimizerConfig, grad_scaler=None,
                 tp_group=None, model_parallel_group=None):
        self.config = config
        self.grad_scaler = grad_scaler
        self.model_parallel_group = model_parallel_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.norm_params = params_for_norm(self.params, tp_group)
        self.adam = torch.optim.AdamW(
            parameter_groups(model, config.weight_decay), lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)

    @property
    def param_groups(self):
        return self.adam.param_groups

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None]:
        """Returns (update applied, grad norm). An fp16 overflow skips the update."""
        if self.grad_scaler is not None:
            inv_scale = 1.0 / self.grad_scaler.scale
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(inv_scale)
            found_inf = found_nonfinite([p.grad for p in self.params if p.grad is not None],
                                        self.model_parallel_group)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return False, None
        grad_norm = global_grad_norm([p.grad for p in self.norm_params if p.grad is not None],
                                     [self.model_parallel_group])
        if self.config.clip_grad > 0:
            clip_grads(self.params, self.config.clip_grad, grad_norm)
        self.adam.step()
        return True, grad_norm.item()

    def checkpoint_segments(self) -> list[tuple]:
        """(param, start, end, main, state key) for each piece of a parameter whose state
        this rank keeps: here every parameter whole, its own fp32 main copy."""
        return [(p, 0, p.numel(), p.detach().view(-1), p) for p in self.params]

    def finish_param_gather(self):
        """Nothing in flight: the parameters are updated in place by step()."""

    def state_dict(self) -> dict:
        state = {"adam": self.adam.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state
