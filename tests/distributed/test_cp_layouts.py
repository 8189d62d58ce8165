"""Context parallelism against the single-process model (docs/design.md §3, §10): CP 2 and 4
with each --cp-comm-type (the ring on both block kernels), and CP composed with TP + SP, DP
with ZeRO-1, DP with FSDP2 (sharded over DP x CP), interleaved PP and recompute, with RoPE
and learned positions, GQA and plain multi-head attention. fp32, dropout 0: the same
per-step losses and grad norms, the same evaluation loss and the same parameters after the
last step. One process launch per world size runs all its layouts."""

import dataclasses
import functools

import pytest
import torch

from megalite.config import OptimizerConfig
from megalite.context_split import shard_batch
from megalite.distributed.fsdp import ZERO3, apply_fsdp, full_tensor
from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import GPTModel, build_model_chunks
from megalite.optimizer.fsdp_optimizer import FullyShardedOptimizer
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.spawn import run_distributed
from megalite.train_step import StepRunner
from megalite.validation import pad_vocab_size

from tests.helpers import (random_batches, reference_name, step_problems, tensor_problem,
                           step_config, tiny_gpt_config)

pytestmark = pytest.mark.slow  # every test here launches processes

VOCAB, SEQ, MICRO, NUM_MICRO, STEPS = 101, 16, 2, 4, 3
# RoPE with GQA (2 K/V heads for 4 query heads), or GPT-2's learned positions with
# multi-head attention; 4 layers so that PP 2 x 2 virtual stages holds one layer a chunk.
MODELS = {
    "rope-gqa": tiny_gpt_config(num_layers=4, num_query_groups=2, seq_length=SEQ,
                                vocab_size=VOCAB, padded_vocab_size=pad_vocab_size(VOCAB, 8, 1),
                                position_embedding_type="rope", swiglu=True,
                                normalization="RMSNorm"),
    "learned-mha": tiny_gpt_config(num_layers=4, seq_length=SEQ, vocab_size=VOCAB,
                                   padded_vocab_size=pad_vocab_size(VOCAB, 8, 1)),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    cp: int
    comm: str
    model: str = "rope-gqa"
    tp: int = 1
    pp: int = 1
    v: int = 1
    dp: int = 1
    zero: bool = False
    fsdp: str | None = None  # FSDP2's strategy (ZeRO-2/3), sharded over DP x CP
    recompute: str | None = None  # "selective" or "full" (uniform, one layer a group)
    # p2p runs the ring's blocks on the unfused fp32 kernel (blocks.py) unless "sdpa" (torch's
    # fused flash kernels, fused_blocks.py); all_gather and the reference run SDPA.
    backend: str = "unfused"

    def __str__(self):
        return (f"CP={self.cp} {self.comm} TP={self.tp} PP={self.pp} v={self.v} DP={self.dp}"
                f"{' zero' if self.zero else ''}{' FSDP2 ' + self.fsdp if self.fsdp else ''} "
                f"{self.model} recompute={self.recompute}"
                f"{' ' + self.backend if self.comm == 'p2p' else ''}")


LAYOUTS = {
    2: [Layout(2, "p2p"), Layout(2, "all_gather", recompute="full"),
        Layout(2, "p2p", "learned-mha", recompute="selective"),
        Layout(2, "all_gather", "learned-mha"), Layout(2, "p2p", backend="sdpa")],
    4: [Layout(4, "p2p"), Layout(4, "all_gather"), Layout(2, "p2p", tp=2),
        Layout(2, "all_gather", dp=2, zero=True), Layout(2, "p2p", pp=2, v=2),
        Layout(2, "p2p", dp=2, fsdp=ZERO3, backend="sdpa")],
}




def rank_batches(generator, state: ParallelState | None) -> list[dict]:
    """A DP rank's contiguous slice of the micro-batches, cut to its CP rank's chunks."""
    mine = random_batches(generator, VOCAB, MICRO, SEQ, NUM_MICRO, state)
    return mine if state is None else [shard_batch(mb, state.cp_size, state.cp_rank)
                                       for mb in mine]


def run(config, chunks, state, zero=False, fsdp=None):
    """STEPS steps; returns per-step (loss, grad norm) and the evaluation (sum, tokens)."""
    tp_group = state.tp_group if state else None
    mp_group = state.mp_group if state else None
    opt_config = OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5)
    grad_buffer = None
    if fsdp:  # pretrain's grouping: shards and gradient sums over DP x CP
        apply_fsdp(chunks, state.dp_cp_group, torch.device("cpu"), strategy=fsdp)
        optimizer = FullyShardedOptimizer(chunks, opt_config, None, tp_group, mp_group)
    elif state is not None:
        # Small buckets: several per model, parameters split across shard edges.
        grad_buffer = GradBuffer(list(chunks.parameters()), state.dp_cp_group, 3000,
                                 shard=zero)
    if zero:
        optimizer = MixedPrecisionOptimizer(chunks, opt_config, None, tp_group, mp_group,
                                            grad_buffer)
    elif not fsdp:
        optimizer = Optimizer(chunks, opt_config, tp_group=tp_group, model_parallel_group=mp_group)
    num_micro = NUM_MICRO // (state.dp_size if state else 1)
    runner = StepRunner(chunks, optimizer, step_config(config, MICRO, num_micro),
                        state or ParallelState.single_process(), torch.device("cpu"), grad_buffer)
    generator = torch.Generator().manual_seed(3)
    steps = []
    for _ in range(STEPS):
        result = runner.train_step(rank_batches(generator, state))
        steps.append((result.loss, result.grad_norm))
    evaluation = runner.evaluate(rank_batches(generator, state))
    return steps, evaluation


def model_config(layout: Layout, tp: int):
    extra = {}
    if layout.recompute == "full":
        extra = dict(recompute_granularity="full", recompute_method="uniform")
    elif layout.recompute == "selective":
        extra = dict(recompute_granularity="selective")
    if layout.comm == "p2p":
        extra["attention_backend"] = layout.backend
    return dataclasses.replace(MODELS[layout.model], cp_comm_type=layout.comm,
                               padded_vocab_size=pad_vocab_size(VOCAB, 8, tp),
                               sequence_parallel=tp > 1, **extra)


@functools.cache
def reference(model: str):
    """The single-process model's run and final parameters (computed once per model)."""
    ref = torch.nn.ModuleList([GPTModel(MODELS[model], seed=9)])
    steps, evaluation = run(MODELS[model], ref, None)
    return steps, evaluation, {n: p.detach().clone() for n, p in ref[0].named_parameters()}


def compare_layout(rank: int, layout: Layout) -> list[str]:
    world = layout.tp * layout.cp * layout.pp * layout.dp
    state = ParallelState(RankGrid(world, layout.tp, layout.pp, layout.cp), rank)
    config = model_config(layout, layout.tp)
    chunks = build_model_chunks(config, 9, state.pp_rank, layout.pp, layout.v, state.tp_group,
                                cp_group=state.cp_group)
    ref_steps, ref_eval, ref_params = reference(layout.model)
    steps, evaluation = run(config, chunks, state, layout.zero, layout.fsdp)
    last_stage = state.pp_rank == layout.pp - 1
    problems = step_problems(steps, ref_steps, last_stage)
    if last_stage and abs(evaluation[0] / evaluation[1] - ref_eval[0] / ref_eval[1]) > 1e-5:
        problems.append(f"eval loss {evaluation} vs {ref_eval}")
    for name, param in chunks.named_parameters():
        # Adam divides each gradient by its running RMS: round-off in a gradient near eps
        # (the K bias, which softmax ignores; rarely seen vocabulary rows) becomes steps
        # of up to lr = 3e-3, and CP sums each gradient from partial sums in another
        # order. A layout bug moves values by ~lr; round-off stays below 5e-5.
        problems += tensor_problem(f"final value of {name}", full_tensor(param.detach()),
                                   param, ref_params[reference_name(name, param)],
                                   state.tp_group, 5e-5)
    return problems


def context_parallel_equivalence(rank, world_size):
    return {str(layout): compare_layout(rank, layout) for layout in LAYOUTS[world_size]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_gpt_equals_single_process(world_size):
    results = run_distributed(world_size, context_parallel_equivalence, timeout=600)
    failures = {f"rank {rank}, {layout}": problems for rank, result in enumerate(results)
                for layout, problems in result.items() if problems}
    assert not failures, failures
