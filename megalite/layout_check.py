"""Every layout against one process: the numerical contract (docs/design.md §3) checked over
whatever backend the caller runs on, gloo on CPUs in the test suite, NCCL on the user's
GPUs in tools/check_cluster.py (docs/design.md §13). One implementation of the comparisons,
for both.

The tensor comparisons (`gather_tensor_parallel`, `reference_name`, `step_problems`,
`tensor_problem`) take a layout's tensors to the single-process ones. `run_layout` builds a
run from pretrain_gpt.py's flags the way training does (validate_args, ParallelState,
build_model, build_optimizer, StepRunner, the mock-data loader) on the first
`world_size` ranks of the launch and records what the contract fixes: the initial values,
then per step the loss, the grad norm and the values after the update. `first_difference`
names the first step and tensor where a layout leaves the single process.
"""

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.arguments import parse_args
from megalite.data.datasets import build_datasets
from megalite.data.loader import microbatches
from megalite.distributed.fsdp import full_tensor
from megalite.initialize import set_seed
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.params import (is_expert_parallel, partition_dim,
                                             partition_stride, single_process_name,
                                             tp_unshard)
from megalite.tensor_parallel.random import build_rng_tracker
from megalite.train_step import StepRunner
from megalite.training import build_model, build_optimizer
from megalite.validation import validate_args



@dataclass(frozen=True)
class Tolerance:
    step_rtol: float
    """Per-step loss and grad norm, relative."""
    value_rtol: float
    value_atol: float
    """Parameter values after an update."""


# The contract in fp32: per-step loss and grad norm to float round-off (1e-5 relative).
# Values after a few Adam steps to 1e-4 relative and 5e-5 absolute: Adam divides each
# gradient by its own running RMS, so round-off in a gradient that is zero in exact
# arithmetic (the K bias) becomes a step of up to lr; a layout bug moves values by ~lr.
FP32 = Tolerance(1e-5, 1e-4, 5e-5)
# bf16, a bound of our own: the same half-precision math summed in other orders; 8
# mantissa bits are ~4e-3 per rounding, and a few steps compound it.
BF16 = Tolerance(2e-2, 2e-2, 2e-2)


# ------------------------------------------------------------------ tensor comparisons

def gather_tensor_parallel(tensor, param, group) -> torch.Tensor:
    """The full tensor of a TP-sharded parameter's `tensor` (its value or grad), gathered
    with plain dist.all_gather; replicated parameters are returned as they are. A stacked
    parameter (SwiGLU's fc1, [gate; up]) holds a block of each part on every rank: the
    full tensor is all ranks' gate blocks, then all ranks' up blocks."""
    if partition_dim(param) is None or group is None or dist.get_world_size(group) == 1:
        return tensor
    return tp_unshard(_all_gathered(tensor, group), partition_dim(param), partition_stride(param))


def _all_gathered(tensor, group) -> list[torch.Tensor]:
    """Every rank's `tensor` of `group`, with plain dist.all_gather."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def reference_name(name: str, param) -> str:
    """A chunk parameter's name ("<chunk>.<name>") in the single-process model."""
    return single_process_name(name.split(".", 1)[1], param)


def step_problems(steps, ref_steps, last_stage: bool,
                  rtol: float = FP32.step_rtol) -> list[str]:
    """Per-step (loss, grad norm) against the single-process run's, to `rtol`; the loss
    only where it is computed, on the last pipeline stage."""
    problems = []
    for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(steps, ref_steps), start=1):
        if (last_stage and abs(loss - ref_loss) > rtol * abs(ref_loss)) or \
                abs(norm - ref_norm) > rtol * abs(ref_norm):
            problems.append(f"step {i}: loss {loss} vs {ref_loss}, norm {norm} vs {ref_norm}")
    return problems


def tensor_problem(what: str, mine, param, expected, tp_group, atol: float,
                   rtol: float = 1e-4) -> list[str]:
    """`mine` (a value or grad of `param`, TP-gathered here) against the single-process
    tensor, to `rtol` and `atol`; vocabulary padding rows (which differ with TP) are left
    out."""
    full = gather_tensor_parallel(mine, param, tp_group)
    return _close_problem(what, full, expected, rtol, atol)


def _close_problem(what, full, expected, rtol, atol) -> list[str]:
    rows = min(full.shape[0], expected.shape[0])
    a, b = full[:rows].float().cpu(), expected[:rows].float().cpu()
    if torch.allclose(a, b, rtol=rtol, atol=atol):
        return []
    return [f"{what}: max diff {(a - b).abs().max().item():.3g}"]


# ------------------------------------------------------------------ a layout's run

@dataclass
class LayoutRun:
    """What one rank saw of a run: tensors by their single-process names."""
    last_stage: bool
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[tuple[float, float]] = field(default_factory=list)
    values: list[dict[str, torch.Tensor]] = field(default_factory=list)


# One ParallelState per rank grid for the life of the process: every rank of the launch
# meets in each `new_group` (a store barrier), ~35 of them per grid at 8 ranks, which cost
# more than a tiny layout's steps; the layouts of a grid differ in flags, not in groups.
_STATES: dict = {}


def parallel_state(grid, rank: int) -> ParallelState:
    """This rank's ParallelState of `grid`, created (collectively) the first time; a world
    of one has no groups (its one process needs none, and no other rank meets it)."""
    if grid.world_size == 1:
        return ParallelState.single_process()
    if grid not in _STATES:
        _STATES[grid] = ParallelState(grid, rank)
    return _STATES[grid]


def build_run(flags: list[str], world_size: int, rank: int, device: torch.device):
    """pretrain_gpt.py's pieces for `flags` on ranks [0, world_size) of the launch:
    (config, state, model, optimizer, runner, micro-batch iterator). Every rank of the
    launch calls this (process groups are created collectively); a rank outside the
    layout gets None for everything but config and state."""
    config = validate_args(parse_args(flags), world_size)
    state = parallel_state(config.parallel.grid, rank)
    if rank >= world_size:
        return config, state, None, None, None, None
    set_seed(config.training.seed)
    tracker = build_rng_tracker(config.training.seed, state.tp_rank, device, state.cp_rank,
                                state.tp_size)
    model = build_model(config, state, device, tracker)
    optimizer, grad_buffer = build_optimizer(model, config, state)
    # No NaN check: it gathers over every rank of the launch, and a smaller layout runs on
    # some of them only.
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint,
                                                                        check_for_nan=False))
    runner = StepRunner(model, optimizer, config, state, device, grad_buffer)
    train_ds = build_datasets(config, None, is_builder=True, barrier=lambda: None)[0]
    return config, state, model, optimizer, runner, microbatches(train_ds, 0, config, state,
                                                                 device)


def gather_experts(tensor, param, group) -> torch.Tensor:
    """All experts of an expert parameter's `tensor` (EP rank blocks of dim 0, in order),
    gathered with plain dist.all_gather over the EP `group`; other tensors as they are."""
    if not is_expert_parallel(param) or group is None or dist.get_world_size(group) == 1:
        return tensor
    return torch.cat(_all_gathered(tensor, group))


def _full_values(model, state) -> dict[str, torch.Tensor]:
    """Every parameter of this rank, gathered whole (FSDP2 over DP x CP, then TP, then the
    experts over EP), by its single-process name, on the host."""
    out = {}
    for name, param in model.named_parameters():
        full = gather_tensor_parallel(full_tensor(param.detach()), param, state.tp_group)
        full = gather_experts(full, param, state.ep_group)
        out[reference_name(name, param)] = full.float().cpu().clone()
    return out


def run_layout(flags: list[str], world_size: int, rank: int, device: torch.device,
               steps: int) -> LayoutRun | None:
    """`steps` training steps of `flags` at `world_size` ranks; None on ranks outside it."""
    config, state, model, optimizer, runner, batches = build_run(flags, world_size, rank,
                                                                 device)
    if model is None:
        return None
    run = LayoutRun(last_stage=state.pp_rank == state.pp_size - 1,
                    initial=_full_values(model, state))
    for _ in range(steps):
        result = runner.train_step([next(batches)
                                    for _ in range(config.training.num_microbatches)])
        optimizer.finish_param_gather()
        run.steps.append((result.loss, result.grad_norm))
        run.values.append(_full_values(model, state))
    return run


def first_difference(run: LayoutRun, reference: LayoutRun,
                     tolerance: Tolerance = FP32) -> str | None:
    """The first place `run` leaves `reference`: an initial value (exactly equal, on the
    real vocabulary rows), else the first step whose loss, grad norm or any value after
    the update differs, naming the first tensor. None when they agree."""
    for name, value in run.initial.items():
        ref = reference.initial[name]
        rows = min(value.shape[0], ref.shape[0])
        if value.shape[1:] != ref.shape[1:] or not torch.equal(value[:rows], ref[:rows]):
            diff = (value[:rows] - ref[:rows]).abs().max().item() \
                if value.shape[1:] == ref.shape[1:] else float("nan")
            return f"initial value of {name} differs (max diff {diff:.3g})"
    for i, (mine, ref_step) in enumerate(zip(run.steps, reference.steps)):
        problems = step_problems([mine], [ref_step], run.last_stage, tolerance.step_rtol)
        tensors = [p for name, value in run.values[i].items()
                   for p in _close_problem(f"value of {name} after the update", value,
                                           reference.values[i][name], tolerance.value_rtol,
                                           tolerance.value_atol)]
        if problems or tensors:
            where = problems[0].split(": ", 1)[1] if problems else "loss and grad norm agree"
            return f"step {i + 1}: {where}" + (f"; first tensor: {tensors[0]}" if tensors
                                                else "")
    return None


# ------------------------------------------------------------------ the layouts to check

# The optimizer's sharding over DP x CP, by its name in a layout's: plain DP, ZeRO-1, FSDP2
# in either strategy.
SHARDING = {"": (), " ZeRO-1": ("--use-distributed-optimizer",),
            " FSDP2 optim_grads_params": ("--use-torch-fsdp2",),
            " FSDP2 optim_grads": ("--use-torch-fsdp2", "--data-parallel-sharding-strategy",
                                   "optim_grads")}


@dataclass(frozen=True)
class Layout:
    name: str
    flags: tuple[str, ...]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def grids(world_size: int, max_degree: int = 4):
    """Every (tp, pp, cp, dp) of `world_size` ranks with TP, PP and CP up to `max_degree`, DP
    filling the rest: the rank grids the cluster check checks and its --tune enumerates."""
    for tp in _divisors(world_size, max_degree):
        for pp in _divisors(world_size // tp, max_degree):
            for cp in _divisors(world_size // (tp * pp), max_degree):
                yield tp, pp, cp, world_size // (tp * pp * cp)


def axes_name(*sizes: tuple[str, int]) -> str:
    """"TP2 x PP2 x DP2" of (("TP", 2), ("PP", 2), ("CP", 1), ("DP", 2)): the split axes."""
    return " x ".join(f"{axis}{size}" for axis, size in sizes if size > 1)


def grid_flags(tp: int, pp: int, cp: int, layers_per_virtual_stage: int | None = None
               ) -> list[str]:
    """pretrain_gpt.py's flags of a grid (TP always with SP)."""
    flags = []
    if tp > 1:
        flags += ["--tensor-model-parallel-size", str(tp), "--sequence-parallel"]
    if pp > 1:
        flags += ["--pipeline-model-parallel-size", str(pp)]
    if layers_per_virtual_stage:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(layers_per_virtual_stage)]
    if cp > 1:
        flags += ["--context-parallel-size", str(cp)]
    return flags


def layouts_for(world_size: int, max_degree: int = 4) -> list[Layout]:
    """Every kind of layout at `world_size` ranks, each filling the launch with DP: TP + SP,
    PP (1F1B, interleaved, GPipe, ZB-H1), CP (p2p and all_gather) alone and in products,
    and over DP alone or a product: plain, ZeRO-1 (with overlapped reduction and gather),
    FSDP2 (both strategies, with and without optimizer offload). Degrees up to
    `max_degree`. validate_args decides which of them fit a model (a refused one is
    reported as skipped, with its reason)."""
    return [layout for grid in grids(world_size, max_degree) for layout in _variants(*grid)]


def _variants(tp: int, pp: int, cp: int, dp: int) -> list[Layout]:
    name = axes_name(("TP", tp), ("PP", pp), ("CP", cp), ("DP", dp)) or "1"
    grid = grid_flags(tp, pp, cp)
    alone = sum(size > 1 for size in (tp, pp, cp)) <= 1
    kinds = {"": []}
    if pp > 1 and alone:  # every schedule where the pipeline is the only model split
        kinds = {" 1f1b": [], " interleaved": ["--num-layers-per-virtual-pipeline-stage", "1"],
                 " gpipe": ["--pipeline-schedule", "gpipe"],
                 " zb-h1": ["--pipeline-schedule", "zb-h1"]}
    if cp > 1 and alone:
        kinds = {" p2p": ["--cp-comm-type", "p2p"],
                 " all_gather": ["--cp-comm-type", "all_gather"]}
    zero1 = (*SHARDING[" ZeRO-1"], "--overlap-grad-reduce", "--overlap-param-gather")
    sharding = {**SHARDING, " ZeRO-1": zero1}
    if tp == pp == cp == 1:  # every FSDP2 strategy, with and without offload, over DP
        sharding.update({f"{name} + offload": (*flags, "--optimizer-cpu-offload")
                         for name, flags in SHARDING.items() if "FSDP2" in name})
    else:
        del sharding[" FSDP2 optim_grads"]
    if dp * cp == 1:  # nothing to shard over
        sharding = {"": ()}
    first = next(iter(kinds))  # the other schedules and CP kinds unsharded only
    return [Layout(name + kind + shard, (*grid, *kind_flags, *shard_flags))
            for kind, kind_flags in kinds.items() for shard, shard_flags in sharding.items()
            if kind == first or not shard]
