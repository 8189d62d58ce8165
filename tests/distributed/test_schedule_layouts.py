"""GPipe and ZB-H1 (issue 16) against the single-process model, and the split backward's
linear layers under tensor and sequence parallelism.

One launch per world size runs every layout of that size: a few steps of the same
per-step losses and grad norms as one process, the same gradients after the first step
and the same parameters after the last (docs/design.md §3, §5). The single-process reference
runs once, in the test process, and travels to the ranks. fp32, dropout 0.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megalite.config import OptimizerConfig
from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import GPTModel, build_model_chunks
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.spawn import run_distributed
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.weight_grad import WeightGradStore
from megalite.train_step import StepRunner
from megalite.validation import pad_vocab_size

from tests.helpers import (random_batches, reference_name, step_problems, tensor_problem,
                           step_config, tiny_gpt_config)

pytestmark = pytest.mark.slow  # every test here launches processes

VOCAB, SEQ, MICRO, NUM_MICRO, STEPS = 101, 16, 2, 4, 3
BASE = tiny_gpt_config(num_layers=4, num_query_groups=2, seq_length=SEQ,
                       padded_vocab_size=pad_vocab_size(VOCAB, 8, 1), vocab_size=VOCAB,
                       position_embedding_type="rope", swiglu=True, normalization="RMSNorm")
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1)
# (TP, PP, DP, --pipeline-schedule, mode, recompute); mode "plain" or "zero-overlap"
# (ZeRO-1 with --overlap-grad-reduce: bucket readiness must wait for the W passes).
LAYOUTS = {2: [(1, 2, 1, "gpipe", "plain", False), (1, 2, 1, "zb-h1", "plain", False),
               (1, 2, 1, "zb-h1", "plain", True)],
           4: [(1, 4, 1, "gpipe", "plain", False), (1, 4, 1, "zb-h1", "plain", False),
               (2, 2, 1, "zb-h1", "plain", False), (1, 2, 2, "zb-h1", "zero-overlap", False)]}




def run(config, chunks, state=None, schedule="1f1b", mode="plain"):
    """STEPS steps; returns per-step (loss, grad norm), first-step grads, final params."""
    zero = mode.startswith("zero")
    opt_config = OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5)
    grad_buffer = None
    if state is None:
        optimizer = Optimizer(chunks, opt_config)
    else:
        # Small buckets: several per model, so readiness is tracked per bucket.
        grad_buffer = GradBuffer(list(chunks.parameters()), state.dp_group, 3000,
                                 shard=zero, overlap=zero)
        optimizer = (MixedPrecisionOptimizer(chunks, opt_config, None, state.tp_group,
                                             state.mp_group, grad_buffer) if zero else
                     Optimizer(chunks, opt_config, tp_group=state.tp_group,
                               model_parallel_group=state.mp_group))
    dp = state.dp_size if state else 1
    runner = StepRunner(chunks, optimizer,
                        step_config(config, MICRO, NUM_MICRO // dp, pipeline_schedule=schedule),
                        state or ParallelState.single_process(), torch.device("cpu"), grad_buffer)
    generator = torch.Generator().manual_seed(3)
    steps, first_grads = [], None
    for step in range(STEPS):
        result = runner.train_step(random_batches(generator, VOCAB, MICRO, SEQ, NUM_MICRO, state))
        steps.append((result.loss, result.grad_norm))
        if zero and grad_buffer.launched_during_backward != len(grad_buffer.buckets):
            raise AssertionError(f"{grad_buffer.launched_during_backward} of "
                                 f"{len(grad_buffer.buckets)} buckets launched in the step")
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in chunks.named_parameters()}
    params = {n: p.detach().clone() for n, p in chunks.named_parameters()}
    return steps, first_grads, params


def reference():
    return run(BASE, torch.nn.ModuleList([GPTModel(BASE, seed=9)]))


def compare_layout(rank, tp, pp, dp, schedule, mode, recompute, ref) -> list[str]:
    ref_steps, ref_grads, ref_params = ref
    state = ParallelState(RankGrid(tp * pp * dp, tp, pp), rank)
    config = dataclasses.replace(BASE, padded_vocab_size=pad_vocab_size(VOCAB, 8, tp),
                                 sequence_parallel=tp > 1, **(RECOMPUTE if recompute else {}))
    chunks = build_model_chunks(config, 9, state.pp_rank, pp, 1, state.tp_group)
    steps, grads, params = run(config, chunks, state, schedule, mode)
    problems = step_problems(steps, ref_steps, state.pp_rank == pp - 1)
    for name, param in chunks.named_parameters():
        ref_name = reference_name(name, param)
        # Final values to 2e-5: Adam turns round-off in zero-in-exact-arithmetic grads into
        # steps up to lr (see test_layouts_gpt.py); a layout bug moves them by ~lr.
        checks = [("final value", params[name], ref_params["0." + ref_name], 2e-5)]
        if not mode.startswith("zero"):  # under ZeRO-1 only this rank's shard is reduced
            checks.append(("first-step grad", grads[name], ref_grads["0." + ref_name], 1e-6))
        for what, mine, expected, atol in checks:
            problems += tensor_problem(f"{what} of {name}", mine, param, expected,
                                       state.tp_group, atol)
    return problems


def split_linears_bit_for_bit(rank, world_size) -> list[str]:
    """Column- and row-parallel layers, with and without SP: B then W gives the input and
    weight gradients of one backward, bit for bit, on every TP rank."""
    group = dist.new_group(list(range(world_size)))
    problems = []
    gen = torch.Generator().manual_seed(0)
    for sp in (False, True):
        for make in (lambda: ColumnParallelLinear(16, 24, group=group, sequence_parallel=sp),
                     lambda: RowParallelLinear(24, 16, group=group, sequence_parallel=sp)):
            module = make()
            for p in module.parameters():
                p.data.copy_(torch.randn(p.shape, generator=gen))
            column = isinstance(module, ColumnParallelLinear)
            seq = 8 // world_size if column and sp else 8
            features = 16 if column else 24 // world_size
            x = torch.randn(seq, 2, features, generator=gen)
            out_shape = module(x).shape
            grad_out = torch.randn(out_shape, generator=gen)
            results = []
            for split in (False, True):
                module.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_()
                store = WeightGradStore()
                if split:
                    with module.linear_step.defer_weight_grads(store):
                        module(xi).backward(grad_out)
                    if module.weight.grad is not None:
                        problems.append(f"{type(module).__name__} sp={sp}: dW in B")
                    store.run()
                else:
                    module(xi).backward(grad_out)
                results.append([xi.grad] + [p.grad for p in module.parameters()])
            for one, two in zip(*results):
                if not torch.equal(one, two):
                    problems.append(f"{type(module).__name__} sp={sp}: B+W differs")
    return problems


def schedules_equal_single_process(rank, world_size, ref):
    results = {f"TP={tp} PP={pp} DP={dp} {schedule} {mode}"
               f"{' recompute' if recompute else ''}":
               compare_layout(rank, tp, pp, dp, schedule, mode, recompute, ref)
               for tp, pp, dp, schedule, mode, recompute in LAYOUTS[world_size]}
    if world_size == 2:
        results["split linears, TP=2"] = split_linears_bit_for_bit(rank, world_size)
    return results


@pytest.fixture(scope="module")
def single_process():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run; more threads only contend on a small CPU
    try:
        return reference()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world_size", [2, 4])
def test_schedules_equal_single_process(world_size, single_process):
    results = run_distributed(world_size, schedules_equal_single_process, single_process,
                              timeout=600)
    failures = {f"rank {rank}, {layout}": problems for rank, result in enumerate(results)
                for layout, problems in result.items() if problems}
    assert not failures, failures
