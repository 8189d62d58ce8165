"""Uneven pipeline stages (issue 29; Megatron's --decoder-first/last-pipeline-num-layers and
--account-for-embedding/loss-in-pipeline-split) against the single-process model, under
every schedule: the same per-step losses and grad norms, first-step gradients and final
parameters (docs/design.md §3, §15); and a checkpoint saved at one uneven split loads at
another. One launch of 4 ranks runs every layout; the single-process reference runs once,
in the test process. fp32, dropout 0."""

import dataclasses

import pytest
import torch

from megalite.checkpointing.loading import load_checkpoint
from megalite.checkpointing.saving import save_checkpoint
from megalite.checkpointing.state import CheckpointState, TrainState
from megalite.config import OptimizerConfig, SchedulerConfig
from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import GPTModel, build_model_chunks
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.pipeline_parallel.stages import stage_layer_counts
from megalite.spawn import run_distributed
from megalite.train_step import StepRunner
from megalite.validation import pad_vocab_size

from tests.helpers import (random_batches, reference_name, step_problems, tensor_problem,
                           step_config, tiny_gpt_config)

pytestmark = pytest.mark.slow  # launches processes

VOCAB, SEQ, MICRO, NUM_MICRO, STEPS = 101, 16, 2, 4, 2
BASE = tiny_gpt_config(num_layers=6, seq_length=SEQ, vocab_size=VOCAB,
                       padded_vocab_size=pad_vocab_size(VOCAB, 8, 1))
# (TP, PP, v, DP, --pipeline-schedule, stage_layer_counts keywords) -> layers per stage
LAYOUTS = [
    (1, 4, 1, 1, "1f1b", dict(first=1, last=1)),                       # 1 2 2 1 (saved)
    (1, 4, 1, 1, "gpipe", dict(first=0, last=2)),                      # 0 2 2 2
    (1, 4, 1, 1, "zb-h1", dict(last=3)),                               # 1 1 1 3
    (2, 2, 2, 1, "1f1b", dict(first=2)),                               # 1 2 | 1 2 (loads)
]
SAVED, LOADS = 0, 3  # LAYOUTS[SAVED] saves its final state, LAYOUTS[LOADS] loads it


def make_optimizer(chunks, state):
    opt_config = OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5)
    optimizer = Optimizer(chunks, opt_config, tp_group=state and state.tp_group,
                          model_parallel_group=state and state.mp_group)
    return optimizer, LRScheduler(optimizer, SchedulerConfig(
        max_lr=3e-3, min_lr=3e-3, decay_style="constant", warmup_steps=0, decay_steps=1))


def run(config, chunks, state=None, schedule="1f1b", save=None):
    """STEPS steps; returns per-step (loss, grad norm), first-step grads, final params.
    The final state is saved to `save` if given."""
    optimizer, scheduler = make_optimizer(chunks, state)
    grad_buffer = None
    if state is not None:
        grad_buffer = GradBuffer(list(chunks.parameters()), state.dp_group, 5000)
    dp = state.dp_size if state else 1
    run_config = step_config(config, MICRO, NUM_MICRO // dp, pipeline_schedule=schedule)
    runner = StepRunner(chunks, optimizer, run_config, state or ParallelState.single_process(),
                        torch.device("cpu"), grad_buffer)
    generator = torch.Generator().manual_seed(3)
    steps, first_grads = [], None
    for step in range(STEPS):
        result = runner.train_step(random_batches(generator, VOCAB, MICRO, SEQ, NUM_MICRO, state))
        steps.append((result.loss, result.grad_norm))
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in chunks.named_parameters()}
    if save is not None:
        save_checkpoint(save, STEPS, CheckpointState(chunks, optimizer, scheduler, state,
                                                     run_config,
                                                     TrainState(STEPS, STEPS * MICRO * NUM_MICRO)))
    return steps, first_grads, {n: p.detach().clone() for n, p in chunks.named_parameters()}


def compare_layout(rank, tp, pp, v, dp, schedule, split, ref, save=None,
                   load=None) -> list[str]:
    ref_steps, ref_grads, ref_params = ref
    state = ParallelState(RankGrid(tp * pp * dp, tp, pp), rank)
    config = dataclasses.replace(BASE, padded_vocab_size=pad_vocab_size(VOCAB, 8, tp),
                                 sequence_parallel=tp > 1)
    counts = stage_layer_counts(BASE.num_layers, pp, v, **split)

    def build():
        return build_model_chunks(config, 9, state.pp_rank, pp, v, state.tp_group,
                                  layer_counts=counts)
    chunks = build()
    steps, grads, params = run(config, chunks, state, schedule, save)
    problems = []
    if load is not None:  # the saved layout's final parameters, here: the reference's
        loaded = build()
        optimizer, scheduler = make_optimizer(loaded, state)
        load_checkpoint(load, CheckpointState(loaded, optimizer, scheduler, state,
                                              step_config(config, MICRO, NUM_MICRO // dp)))
        for name, param in loaded.named_parameters():
            problems += tensor_problem(f"loaded {name}", param.detach(), param,
                                       ref_params["0." + reference_name(name, param)],
                                       state.tp_group, 2e-5)
    problems += step_problems(steps, ref_steps, state.pp_rank == pp - 1)
    for name, param in chunks.named_parameters():
        ref_name = "0." + reference_name(name, param)
        # Final values to 2e-5 (see test_layouts_gpt.py: Adam turns round-off into steps).
        for what, mine, expected, atol in [("final value", params[name], ref_params[ref_name],
                                            2e-5),
                                           ("first-step grad", grads[name], ref_grads[ref_name],
                                            1e-6)]:
            problems += tensor_problem(f"{what} of {name}", mine, param, expected,
                                       state.tp_group, atol)
    return problems


def all_layouts(rank, world_size, ref, directory):
    return {f"TP={tp} PP={pp} v={v} DP={dp} {schedule} {split}":
            compare_layout(rank, tp, pp, v, dp, schedule, split, ref,
                           save=directory if i == SAVED else None,
                           load=directory if i == LOADS else None)
            for i, (tp, pp, v, dp, schedule, split) in enumerate(LAYOUTS)}


def test_uneven_stages_equal_single_process(tmp_path):
    ref = run(BASE, torch.nn.ModuleList([GPTModel(BASE, seed=9)]))
    results = run_distributed(4, all_layouts, ref, str(tmp_path / "ckpt"), timeout=600)
    failures = {f"rank {rank}, {layout}": problems for rank, result in enumerate(results)
                for layout, problems in result.items() if problems}
    assert not failures, failures

