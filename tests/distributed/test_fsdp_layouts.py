"""FSDP2 (--use-torch-fsdp2, ZeRO-2 and ZeRO-3) at data-, tensor- and pipeline-parallel
layouts against the single-process model (docs/design.md §3, §6): the same per-step losses and
grad norms for 6 steps, with gradient accumulation over micro-batches and clipping, and the
same parameters after the last step; pretrain's model built on `meta` and initialised
shard by shard, against the single-process initial values; optimizer CPU offload (FSDP2
and ZeRO-1) against the same reference; bf16 and fp16 FSDP2 against the ZeRO-1 run of the
same precision; and the memory planner's FSDP2 bytes against the tensors of a step."""

import contextlib
import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

import megalite.memory_estimate as me
from megalite.arguments import parse_args
from megalite.config import OptimizerConfig, PrecisionConfig
from megalite.distributed.fsdp import ZERO2, ZERO3, apply_fsdp, full_tensor
from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import GPTModel, build_model_chunks
from megalite.optimizer.fsdp_optimizer import FullyShardedOptimizer
from megalite.optimizer.grad_scaler import DynamicGradScaler
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.spawn import run_distributed
from megalite.train_step import StepRunner
from megalite.training import build_model, build_optimizer
from megalite.validation import pad_vocab_size, validate_args

from tests.helpers import (BASE_FLAGS, gather_tensor_parallel, random_batches,
                           reference_name, step_config, step_problems, tiny_gpt_config)

pytestmark = pytest.mark.slow  # every test here launches processes

VOCAB, SEQ, MICRO, NUM_MICRO, STEPS = 101, 16, 2, 4, 6
BASE = tiny_gpt_config(num_layers=4, num_query_groups=2, seq_length=SEQ,
                       padded_vocab_size=pad_vocab_size(VOCAB, 8, 1), vocab_size=VOCAB,
                       position_embedding_type="rope", swiglu=True, normalization="RMSNorm")
OPTIMIZER = OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5)
# (TP, PP, virtual stages, DP, mode, tied): mode is the sharding strategy (ZeRO-2/3),
# optionally with "+offload" (--optimizer-cpu-offload), "+recompute" (full recompute) or
# "+every" (--fsdp-grad-reduce-every-micro-batch); "zero1+offload" is ZeRO-1 with its owned
# shard on the host. World size TP x PP x DP.
LAYOUTS = {2: [(1, 1, 1, 2, ZERO3, True), (1, 1, 1, 2, ZERO2, False),
               (1, 1, 1, 2, ZERO3 + "+offload", False), (1, 1, 1, 2, "zero1+offload", True),
               (1, 1, 1, 2, ZERO2 + "+every", True)],
           4: [(1, 1, 1, 4, ZERO3, False), (1, 1, 1, 4, ZERO2, True),
               (2, 1, 1, 2, ZERO3, False), (2, 1, 1, 2, ZERO2 + "+recompute", True),
               (1, 2, 2, 2, ZERO3, True), (1, 2, 2, 2, ZERO2, True),
               (1, 2, 2, 2, ZERO3 + "+every", True)]}




def layout_optimizer(chunks, state, mode):
    """(optimizer, grad buffer) for `mode`; FSDP2 shards `chunks` in place first."""
    if state is None:
        return Optimizer(chunks, OPTIMIZER), None
    strategy, _, extra = mode.partition("+")
    if strategy == "zero1":
        grad_buffer = GradBuffer(list(chunks.parameters()), state.dp_group, 3000, shard=True)
        return MixedPrecisionOptimizer(chunks, OPTIMIZER, None, state.tp_group, state.mp_group,
                                       grad_buffer, cpu_offload=extra == "offload"), grad_buffer
    apply_fsdp(chunks, state.dp_group, torch.device("cpu"), strategy=strategy,
               cpu_offload=extra == "offload")
    return FullyShardedOptimizer(chunks, OPTIMIZER, None, state.tp_group, state.mp_group), None


def run(config, chunks, state, mode=ZERO3):
    """STEPS steps; returns the per-step (loss, grad norm)."""
    optimizer, grad_buffer = layout_optimizer(chunks, state, mode)
    num_micro = NUM_MICRO // (state.dp_size if state else 1)
    every = mode.endswith("+every")
    runner = StepRunner(chunks, optimizer, step_config(config, MICRO, num_micro,
                                                       fsdp_grad_reduce_every_micro_batch=every),
                        state or ParallelState.single_process(), torch.device("cpu"), grad_buffer)
    generator = torch.Generator().manual_seed(3)
    steps = []
    for _ in range(STEPS):
        with count_reduce_scatters(state.dp_group if state else None) as calls:
            result = runner.train_step(random_batches(generator, VOCAB, MICRO, SEQ,
                                                      NUM_MICRO, state))
        steps.append((result.loss, result.grad_norm))
        # One reduce-scatter per FSDP unit that owns parameters, per step (accumulation
        # without communication) or, with "+every", per micro-batch (2 per rank here).
        expected = owning_units(chunks) * (num_micro if every else 1)
        if isinstance(optimizer, FullyShardedOptimizer) and len(calls) != expected:
            raise AssertionError(f"{len(calls)} reduce-scatters in a step, expected "
                                 f"{expected}")
    optimizer.finish_param_gather()
    return steps


def owning_units(chunks) -> int:
    """FSDP units holding parameters of their own (not only nested units'): each reduce-
    scatters its gradients once per backward in which it syncs."""
    units = [m for m in chunks.modules() if isinstance(m, FSDPModule)]
    count = 0
    for unit in units:
        nested = {id(p) for inner in unit.modules() if inner is not unit and inner in units
                  for p in inner.parameters()}
        count += any(id(p) not in nested for p in unit.parameters())
    return count


@contextlib.contextmanager
def count_reduce_scatters(group):
    """The reduce-scatters FSDP2 issues over `group` (torch.distributed.
    reduce_scatter_single; sequence parallelism's go over the TP group)."""
    calls, original = [], dist.reduce_scatter_single

    def counting(*args, **kwargs):
        if kwargs.get("group") is group:
            calls.append(1)
        return original(*args, **kwargs)
    dist.reduce_scatter_single = counting
    try:
        yield calls
    finally:
        dist.reduce_scatter_single = original


@functools.cache
def single_process(tied: bool):
    """The reference run (per process, once per tying): per-step (loss, grad norm) and
    the final parameters by single-process name."""
    config = dataclasses.replace(BASE, untie_embeddings_and_output_weights=not tied)
    reference = torch.nn.ModuleList([GPTModel(config, seed=9)])
    steps = run(config, reference, None)
    return steps, dict(reference[0].named_parameters())


def compare_layout(rank, tp, pp, v, dp, mode, tied) -> list[str]:
    state = ParallelState(RankGrid(tp * pp * dp, tp, pp), rank)
    ref_config = dataclasses.replace(BASE, untie_embeddings_and_output_weights=not tied)
    config = dataclasses.replace(ref_config, padded_vocab_size=pad_vocab_size(VOCAB, 8, tp),
                                 sequence_parallel=tp > 1)
    if mode.endswith("+recompute"):
        config = dataclasses.replace(config, recompute_granularity="full",
                                     recompute_method="uniform", recompute_num_layers=1)
    ref_steps, ref_params = single_process(tied)
    chunks = build_model_chunks(config, 9, state.pp_rank, pp, v, state.tp_group)
    steps = run(config, chunks, state, mode)
    problems = step_problems(steps, ref_steps, state.pp_rank == pp - 1)
    for name, param in chunks.named_parameters():
        ref = ref_params[reference_name(name, param)].detach()
        full = gather_tensor_parallel(full_tensor(param.detach()), param, state.tp_group)
        rows = min(full.shape[0], ref.shape[0])  # vocabulary paddings differ with TP
        # 2e-5: Adam turns round-off in an exactly-zero gradient into steps of up to lr
        # (see test_layouts_gpt.py); a layout bug moves values by ~lr = 3e-3.
        if not torch.allclose(full[:rows], ref[:rows], rtol=1e-4, atol=2e-5):
            problems.append(f"final value of {name}: max diff "
                            f"{(full[:rows] - ref[:rows]).abs().max().item():.3g}")
    return problems


def fsdp_equivalence(rank, world_size):
    results = {f"TP={tp} PP={pp} v={v} DP={dp} {mode} {'tied' if tied else 'untied'}":
               compare_layout(rank, tp, pp, v, dp, mode, tied)
               for tp, pp, v, dp, mode, tied in LAYOUTS[world_size]}
    if world_size == 2:
        results.update(half_precision_equivalence(rank, world_size))
        results.update(planner_against_tensors(rank, world_size))
    else:
        results.update(initial_values(rank, world_size))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_gpt_equals_single_process(world_size):
    results = run_distributed(world_size, fsdp_equivalence, timeout=600)
    failures = {f"rank {rank}, {layout}": problems for rank, result in enumerate(results)
                for layout, problems in result.items() if problems}
    assert not failures, failures


# ------------------------------------------------------------- start-up on the meta device

def initial_values(rank, world_size) -> dict[str, list[str]]:
    """pretrain's FSDP2 model (built on `meta`, sharded, then given values shard by shard)
    against the single-process model's initial values: fp32 at TP 2 + SP x DP 2 (SwiGLU's
    stacked fc1, a padded vocabulary), and bf16 at PP 2 interleaved x DP 2 with the output
    layer tied across stages (the values rounded to bf16, as a model built in bf16 is)."""
    out = {}
    for name, extra in (("TP 2 + SP x DP 2, fp32",
                         ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                        ("PP 2 interleaved x DP 2, bf16, tied",
                         ["--pipeline-model-parallel-size", "2", "--bf16",
                          "--num-layers-per-virtual-pipeline-stage", "1",
                          "--micro-batch-size", "2"])):
        config = validate_args(parse_args([*BASE_FLAGS, "--num-layers", "4", "--swiglu",
                                           "--seed", "5", "--use-torch-fsdp2", *extra]),
                               world_size)
        state = ParallelState(config.parallel.grid, rank)
        chunks = build_model(config, state, torch.device("cpu"), None)
        one_process = GPTModel(dataclasses.replace(config.model, sequence_parallel=False),
                               seed=5)
        reference = dict(one_process.named_parameters())
        problems = []
        for pname, param in chunks.named_parameters():
            ref = reference[reference_name(pname, param)].detach().to(
                config.precision.params_dtype).float()
            full = gather_tensor_parallel(full_tensor(param.detach()), param, state.tp_group)
            rows = min(full.shape[0], ref.shape[0])  # vocabulary paddings differ with TP
            if full.dtype != torch.float32 or not torch.equal(full[:rows], ref[:rows]):
                problems.append(f"{pname}: {full.dtype}, max diff "
                                f"{(full[:rows].float() - ref[:rows]).abs().max().item():.3g}")
        out[f"initial values, FSDP2 {name}"] = problems
    return out


# ------------------------------------------------------------- mixed precision vs ZeRO-1

def run_half(state, dtype, fsdp: bool):
    """STEPS steps of a half-precision model at DP 2: FSDP2 ZeRO-3 (fp32 shards gathered
    in `dtype`, gradients reduced in fp32) or ZeRO-1 (fp32 gradient buffer and sharded
    main parameters). Returns the per-step (loss, grad norm, loss scale) and the whole
    parameters in `dtype`."""
    # No biases: the K bias's exactly-zero gradient makes Adam amplify round-off.
    config = dataclasses.replace(BASE, num_layers=2, add_bias_linear=False)
    chunks = build_model_chunks(config, 9, tp_group=None, dtype=dtype)
    scaler = DynamicGradScaler(2.0 ** 16, 1.0, window=2, hysteresis=1) \
        if dtype == torch.float16 else None
    if fsdp:
        apply_fsdp(chunks.float(), state.dp_group, torch.device("cpu"), param_dtype=dtype,
                   reduce_dtype=torch.float32)
        optimizer = FullyShardedOptimizer(chunks, OPTIMIZER, scaler, None, None)
        grad_buffer = None
    else:
        grad_buffer = GradBuffer(list(chunks.parameters()), state.dp_group, 3000, shard=True,
                                 grad_dtype=torch.float32)
        optimizer = MixedPrecisionOptimizer(chunks, OPTIMIZER, scaler, None, None, grad_buffer)
    precision = PrecisionConfig(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    runner = StepRunner(chunks, optimizer, step_config(config, MICRO, NUM_MICRO // 2, precision),
                        state, torch.device("cpu"), grad_buffer)
    generator = torch.Generator().manual_seed(3)
    steps = []
    for _ in range(STEPS):
        loss_scale = optimizer.loss_scale
        result = runner.train_step(random_batches(generator, VOCAB, MICRO, SEQ, NUM_MICRO, state))
        steps.append((result.loss, result.grad_norm, loss_scale))
    return steps, {n: full_tensor(p.detach()).to(dtype) for n, p in chunks.named_parameters()}


def half_precision_equivalence(rank, world_size) -> dict[str, list[str]]:
    state = ParallelState(RankGrid(world_size), rank)
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        fsdp_steps, fsdp_params = run_half(state, dtype, fsdp=True)
        zero_steps, zero_params = run_half(state, dtype, fsdp=False)
        # The same half-precision forward and backward, the same fp32 reduction and
        # Adam: only the grad norm sums its squares in another order (per parameter
        # shard vs per bucket shard), an fp32 round-off (1e-4 after 6 steps of Adam)
        # too small to change a half-precision parameter here.
        problems = [f"step {i}: {a} vs ZeRO-1 {b}" for i, (a, b) in
                    enumerate(zip(fsdp_steps, zero_steps), start=1)
                    if abs(a[0] - b[0]) > 1e-5 * b[0] or abs(a[1] - b[1]) > 1e-4 * b[1]
                    or a[2] != b[2]]
        for name, value in fsdp_params.items():
            if not torch.equal(value, zero_params[name]):
                diff = (value.float() - zero_params[name].float()).abs().max().item()
                problems.append(f"final {name}: max diff {diff:.3g}")
        out[f"FSDP2 {dtype} vs ZeRO-1 {dtype}"] = problems
    return out


# ------------------------------------------------------------- the memory planner

def planner_against_tensors(rank, world_size) -> dict[str, list[str]]:
    """pretrain_gpt.py's model and optimizer (--bf16) for ZeRO-2, ZeRO-3 and ZeRO-3 +
    offload after one step of one micro-batch: the bytes of the fp32 shards, their
    gradients and Adam's moments against the planner's persistent bytes (on the CPU the
    "host" of offload is the same memory: the planner's host bytes are checked against
    the same tensors); ZeRO-2's gathered copies against all the parameters in bf16."""
    out = {}
    for name, extra in (("ZeRO-2", ["--data-parallel-sharding-strategy", "optim_grads"]),
                        ("ZeRO-3", []), ("ZeRO-3 + offload", ["--optimizer-cpu-offload"])):
        config = validate_args(parse_args([*BASE_FLAGS, "--bf16", "--use-torch-fsdp2",
                                           *extra]), world_size)
        state = ParallelState(config.parallel.grid, rank)
        model = build_model(config, state, torch.device("cpu"), None)
        optimizer, _ = build_optimizer(model, config, state)
        t, m = config.training, config.model
        runner = StepRunner(model, optimizer, config, state, torch.device("cpu"))
        tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length),
                               generator=torch.Generator().manual_seed(0))
        runner.train_step([{"tokens": tokens, "labels": tokens.roll(-1, 1),
                            "loss_mask": torch.ones(tokens.shape)}] * t.num_microbatches)
        params = list(model.parameters())
        shards = sum(p.to_local().numel() * 4 for p in params)
        measured = {"parameters": shards,
                    "gradients": sum(p.grad.to_local().numel() * 4 for p in params),
                    "optimizer_state": optimizer.optimizer_state_bytes() - shards}
        plan = me.estimate_rank_memory(config, 0, "cpu")
        transient = me.weights_and_optimizer(config, 0)
        gathered = transient["gathered"]
        # The planner's parameters include the gathered compute copies, its gradients
        # one unit's reduction (both transient).
        planned = {"parameters": plan.parameters - gathered,
                   "gradients": plan.gradients - transient["reducing"],
                   "optimizer_state": plan.optimizer_state}
        if extra == ["--optimizer-cpu-offload"]:
            planned, measured = {"host": plan.host}, {"host": sum(measured.values())}
        problems = [f"{k}: planned {planned[k]}, measured {v}" for k, v in measured.items()
                    if planned[k] != v]
        if name == "ZeRO-2" and gathered != 2 * sum(p.numel() for p in params):
            problems.append(f"ZeRO-2 gathers every parameter, planned {gathered} bytes")
        out[f"planner, FSDP2 {name}"] = problems
    return out
