"""Activation recompute gives the loss and gradients of no recompute, dropout on, for every
granularity and method, in one process and under TP 2 with SP and PP 2 (v=2): recomputed
dropout masks must be the ones of the forward, from both the default generator and the
tensor-parallel RNG tracker."""

import dataclasses

import pytest
import torch

from megalite.config import OptimizerConfig
from megalite.model.gpt import build_model_chunks
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.spawn import run_distributed
from megalite.tensor_parallel.random import build_rng_tracker
from megalite.train_step import StepRunner

from tests.helpers import step_config, tiny_gpt_config

SEQ, MICRO, VOCAB = 16, 2, 64
BASE = tiny_gpt_config(num_layers=4, num_query_groups=2, seq_length=SEQ, padded_vocab_size=VOCAB,
                       attention_dropout=0.2, hidden_dropout=0.2, position_embedding_type="rope",
                       swiglu=True, normalization="RMSNorm", attention_backend="unfused")
RECOMPUTE = [dict(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1),
             dict(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=2),
             dict(recompute_granularity="full", recompute_method="block",
                  recompute_num_layers=1),
             dict(recompute_granularity="selective")]


def loss_and_grads(config, state, tp, pp, v):
    """One training step's loss and every gradient (lr 0: nothing moves)."""
    tp_rank = state.tp_rank if state else 0
    torch.manual_seed(1234)
    tracker = build_rng_tracker(1234, tp_rank, "cpu")
    chunks = build_model_chunks(config, 7, state.pp_rank if state else 0, pp, v,
                                state.tp_group if state else None, tracker)
    optimizer = Optimizer(chunks, OptimizerConfig(lr=0.0, clip_grad=0.0),
                          model_parallel_group=state.mp_group if state else None)
    runner = StepRunner(chunks, optimizer, step_config(config, MICRO, 2),
                        state or ParallelState.single_process(), torch.device("cpu"))
    generator = torch.Generator().manual_seed(5)
    batches = [{"tokens": torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator),
                "labels": torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator),
                "loss_mask": torch.ones(MICRO, SEQ)} for _ in range(2)]
    loss = runner.train_step(batches).loss
    return loss, {n: p.grad.clone() for n, p in chunks.named_parameters()}


def compare(state, tp, pp, v) -> list[str]:
    config = dataclasses.replace(BASE, sequence_parallel=tp > 1)
    loss, grads = loss_and_grads(config, state, tp, pp, v)
    problems = []
    for recompute in RECOMPUTE:
        r_loss, r_grads = loss_and_grads(dataclasses.replace(config, **recompute), state,
                                         tp, pp, v)
        if r_loss != loss:
            problems.append(f"{recompute}: loss {r_loss} vs {loss}")
        problems += [f"{recompute}: grad of {n}" for n in grads
                     if not torch.equal(grads[n], r_grads[n])]
    return problems


def test_recompute_matches_in_one_process():
    assert compare(None, 1, 1, 1) == []


def compare_layout(rank, world_size, tp, pp, v):
    return compare(ParallelState(RankGrid(world_size, tp, pp), rank), tp, pp, v)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, v", [(2, 1, 1), (1, 2, 2)])
def test_recompute_matches_under_tensor_and_pipeline_parallelism(tp, pp, v):
    results = run_distributed(tp * pp, compare_layout, tp, pp, v)
    assert all(problems == [] for problems in results), results
