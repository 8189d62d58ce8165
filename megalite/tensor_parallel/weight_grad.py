"""Linear layers whose backward can be split into B and W (Qi et al. 2024, §2; Megatron's
delayed weight-gradient computation).

For Y = X A^T + b the backward has two independent parts: B, the input gradient
dX = dY A, which the previous pipeline stage waits for, and W, the weight gradient
dA = dY^T X, which only the optimizer needs. Every linear layer of the model goes through
`linear` below with its model's `LinearStep`. Inside `step.defer_weight_grads()` (a
zero-bubble schedule's B pass) its backward computes dX (and the bias gradient, cheap and
needed by nobody later) and keeps (A, X, dY) in the store instead of computing dA;
`store.run()` (that micro-batch's W pass) computes each dA and accumulates it into A.grad
through autograd's own accumulation, so the gradient buffer's hooks (readiness, overlapped
reduction, fp32 main grads) see the W pass exactly as they see a backward. The W pass is one
call of the autograd engine: each deferred dA is a root (`_DeferredWeightGrad`) whose backward
computes it, and the engine accumulates a parameter's gradient as soon as it arrives, so one
dA is alive at a time. Nothing else of the graph is kept: X is what the forward saved anyway,
dY what backward would have dropped. Outside the context the backward computes dA at once,
with the same kernels, so B then W gives bit for bit the gradients of one backward. A
schedule without W passes runs its forwards inside `step.unsplit()`, where `linear` is
torch's F.linear.

Parameters outside linear layers (norms, embeddings, biases) get their gradients in B.
"""

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    """The weight-gradient computations of one micro-batch's B pass, run by its W pass."""

    def __init__(self):
        # (A, the function computing dA, its tensors: X and dY, or their FP8 copies)
        self.pending: list[tuple[torch.Tensor, Callable, tuple[torch.Tensor, ...]]] = []
        self.weights: set[int] = set()  # ids of the weights deferred by the B pass

    def run(self):
        """Compute every deferred dA = dY^T X and accumulate it into A.grad."""
        # X and dY detached: the engine must not walk back into the B pass's freed graph.
        roots = [_DeferredWeightGrad.apply(weight, compute, *(t.detach() for t in tensors))
                 for weight, compute, tensors in self.pending]
        self.pending.clear()
        if roots:
            torch.autograd.backward(roots, [root.new_empty(0) for root in roots])


class _DeferredWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, compute, *tensors):
        ctx.compute = compute
        ctx.save_for_backward(*tensors)
        return weight.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        return ctx.compute(*ctx.saved_tensors), None, *(None for _ in ctx.saved_tensors)


class LinearStep:
    """What the linear layers of one model share within a training step: whether `linear`
    builds the node a B pass can split, the store of the B pass running now, and the FP8
    copies of the weights made once a step (fp8.quantize_weights_once). The step that runs
    the model owns it (train_step.StepRunner) and installs it on the layers (`install`):
    two models in one process never share one. A layer built alone has one of its own, so
    outside that one's contexts it computes its gradients in the backward and quantizes its
    weight at every call."""

    def __init__(self):
        self.splittable = True
        # Read by autograd's backward functions: on a GPU those run on its own device
        # thread, so this is a plain attribute, not a thread-local.
        self.store: WeightGradStore | None = None
        self.fp8_weights: dict | None = None
        """(id(weight), dtype) -> (weight, its FP8 copies A and A^T) inside
        fp8.quantize_weights_once, else None."""

    def install(self, model: nn.Module):
        """Every layer of `model` that runs `linear` (it has a `linear_step`) runs with
        this one."""
        for module in model.modules():
            if hasattr(module, "linear_step"):
                module.linear_step = self

    def defer_weight_grads(self, store: WeightGradStore):
        """The layers' backwards inside this context leave their weight gradients in
        `store` (B of a split backward)."""
        if self.store is not None:
            raise RuntimeError("defer_weight_grads is already active: one B pass at a time")
        return temporarily(self, "store", store)

    def unsplit(self):
        """The layers' forwards inside this context build torch's own F.linear node, whose
        backward computes dA at once: for a schedule without W passes. It is ~40 us per
        layer and step cheaper than the custom function on a CPU (Python forward and
        backward), and its dA (X^T dY, transposed) is bit for bit the custom one's on the
        CPU (tests/test_weight_grad.py)."""
        return temporarily(self, "splittable", False)

    def deferred(self, param: torch.Tensor) -> bool:
        """Whether the B pass running now deferred `param`'s gradient. Autograd still calls
        the parameter's post-accumulate-grad hooks then, with nothing accumulated, so a
        gradient buffer counting accumulations must not count that call."""
        return self.store is not None and id(param) in self.store.weights

    def weight_grad_now_or_deferred(self, weight: torch.Tensor, compute: Callable,
                                    *tensors: torch.Tensor) -> torch.Tensor | None:
        """dA = compute(*tensors) now, or None inside `defer_weight_grads`, which keeps the
        computation for the W pass."""
        if self.store is None:
            return compute(*tensors)
        self.store.pending.append((weight, compute, tensors))
        self.store.weights.add(id(weight))
        return None


@contextlib.contextmanager
def temporarily(obj, name: str, value):
    """obj.<name> = value inside the context (which yields it), the previous value after."""
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield value
    finally:
        setattr(obj, name, previous)


def weight_grad(x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """dA = dY^T X over all leading (sequence, batch) dims, in one matrix product."""
    return grad_output.reshape(-1, grad_output.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, step):
        ctx.step = step
        # Fold the leading dims as F.linear's matmul does (a copy when x is not contiguous,
        # e.g. the attention output) and keep the folded input, as F.linear keeps it: the
        # same tensors saved, so the memory planner's counts hold for both.
        x2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2d, weight)
        # Written through a 2-D view into a tensor of its own: a returned view could not be
        # modified in place (the vocab-parallel loss does that to the logits).
        y = x2d.new_empty(*x.shape[:-1], weight.shape[0])
        if bias is None:
            torch.mm(x2d, weight.t(), out=y.view(-1, weight.shape[0]))
        else:
            torch.addmm(bias, x2d, weight.t(), out=y.view(-1, weight.shape[0]))
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_x = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = None
        if ctx.needs_input_grad[2]:  # False for a bias of None
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = ctx.step.weight_grad_now_or_deferred(weight, weight_grad, x,
                                                               grad_output)
        return grad_x, grad_weight, grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           step: LinearStep):
    """F.linear whose weight gradient a split backward can defer (`step`: the model's, which
    says whether and where to). Under autocast the operands are cast as autocast would cast
    them for F.linear (a custom autograd function is not autocast's business): parameters
    already in the autocast dtype stay the very tensors, so the deferred gradient lands on
    them."""
    if not step.splittable:
        return F.linear(x, weight, bias)
    return apply_as_autocast_would(_Linear.apply, x, weight, bias, step)


def apply_as_autocast_would(function, x, weight, bias, *args):
    """function(x, weight, bias, *args) with x, weight and bias cast to the autocast dtype
    when autocast is on (as it casts them for F.linear), run with autocast off."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return function(x, weight, bias, *args)
    return function(x, weight, bias, *args)
