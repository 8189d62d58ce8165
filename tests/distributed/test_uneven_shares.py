"""Uneven data-parallel shares (issue 29) against the single-process model: each DP rank
computes its own number of micro-batches of the same global batches, and the per-step
losses and grad norms and the final parameters are one process's (docs/design.md §3, §15),
at DP 4 with ZeRO-1 and shares 1:1:2:4 that then change (what --data-parallel-shares auto
does), and 3:1 with TP 2 + SP and with interleaved PP 2. One launch of 4 ranks; fp32, dropout 0. Then the flags end to end: auto on a slowed rank through
pretrain_gpt.py, and its checkpoint resumed in one process."""

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from megalite.checkpointing.storage import TRACKER_FILENAME
from megalite.config import OptimizerConfig
from megalite.data.shares import split_microbatches
from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import GPTModel, build_model_chunks
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.spawn import run_distributed, torchrun_command
from megalite.train_step import StepRunner
from megalite.training import pretrain
from megalite.training_log import parse_log
from megalite.validation import pad_vocab_size

from tests.helpers import (flags_with, random_batches, reference_name, step_problems,
                           tensor_problem, step_config, tiny_gpt_config)

pytestmark = pytest.mark.slow  # launches processes

VOCAB, SEQ, MICRO, NUM_MICRO, STEPS = 101, 16, 1, 8, 2
BASE = tiny_gpt_config(num_layers=4, seq_length=SEQ, vocab_size=VOCAB,
                       padded_vocab_size=pad_vocab_size(VOCAB, 8, 1))
# (TP, PP, v, DP, ZeRO-1, each step's micro-batches per DP rank)
LAYOUTS = [
    (1, 1, 1, 4, True, [(1, 1, 2, 4), (4, 2, 1, 1)]),  # re-balanced, ZeRO-1
    (2, 1, 1, 2, False, [(6, 2)] * STEPS),             # 3:1
    (1, 2, 2, 2, False, [(2, 6)] * STEPS),             # interleaved PP 2: multiples of p
]


def shard(batch: list[dict], shares, dp_rank: int) -> list[dict]:
    """This DP rank's micro-batches: those after the ranks before it (as the sampler)."""
    start = sum(shares[:dp_rank])
    return batch[start:start + shares[dp_rank]]


def run(config, chunks, state=None, zero=False, plan=None):
    """STEPS steps; returns per-step (loss, grad norm) and the final params."""
    opt = OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5)
    grad_buffer = None
    if state is None:
        optimizer = Optimizer(chunks, opt)
    else:
        grad_buffer = GradBuffer(list(chunks.parameters()), state.dp_group, 20000, shard=zero)
        optimizer = (MixedPrecisionOptimizer(chunks, opt, None, state.tp_group, state.mp_group,
                                             grad_buffer) if zero else
                     Optimizer(chunks, opt, tp_group=state.tp_group,
                               model_parallel_group=state.mp_group))
    # The runner is configured for an even split; it plans for what each step gives it.
    dp = state.dp_size if state else 1
    runner = StepRunner(chunks, optimizer, step_config(config, MICRO, NUM_MICRO // dp),
                        state or ParallelState.single_process(), torch.device("cpu"), grad_buffer)
    generator = torch.Generator().manual_seed(3)
    steps = []
    for step in range(STEPS):
        batch = random_batches(generator, VOCAB, MICRO, SEQ, NUM_MICRO)
        if state is not None:
            batch = shard(batch, plan[step], state.dp_rank)
        result = runner.train_step(batch)
        steps.append((result.loss, result.grad_norm))
    return steps, {n: p.detach().clone() for n, p in chunks.named_parameters()}


def compare_layout(rank, tp, pp, v, dp, zero, plan, ref) -> list[str]:
    ref_steps, ref_params = ref
    state = ParallelState(RankGrid(tp * pp * dp, tp, pp), rank)
    config = dataclasses.replace(BASE, padded_vocab_size=pad_vocab_size(VOCAB, 8, tp),
                                 sequence_parallel=tp > 1)
    chunks = build_model_chunks(config, 9, state.pp_rank, pp, v, state.tp_group)
    steps, params = run(config, chunks, state, zero, plan)
    problems = step_problems(steps, ref_steps, state.pp_rank == pp - 1)
    for name, param in chunks.named_parameters():
        # Final values to 2e-5 (see test_layouts_gpt.py: Adam turns round-off into steps).
        problems += tensor_problem(f"final value of {name}", params[name], param,
                                   ref_params["0." + reference_name(name, param)],
                                   state.tp_group, 2e-5)
    return problems


def all_layouts(rank, world_size, ref):
    return {f"TP={tp} PP={pp} v={v} DP={dp} zero={zero} shares={plan}":
            compare_layout(rank, tp, pp, v, dp, zero, plan, ref)
            for tp, pp, v, dp, zero, plan in LAYOUTS}


def test_uneven_shares_equal_single_process():
    assert split_microbatches([3, 1], NUM_MICRO) == (6, 2)
    assert split_microbatches([1, 1, 2, 4], NUM_MICRO) == (1, 1, 2, 4)
    ref = run(BASE, torch.nn.ModuleList([GPTModel(BASE, seed=9)]))
    results = run_distributed(4, all_layouts, ref, timeout=600)
    failures = {f"rank {rank}, {layout}": problems for rank, result in enumerate(results)
                for layout, problems in result.items() if problems}
    assert not failures, failures


ROOT = Path(__file__).resolve().parent.parent.parent
FLAGS = flags_with("--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                   "--distributed-backend", "gloo", "--attention-dropout", "0",
                   "--hidden-dropout", "0", vocab_size=61, make_vocab_size_divisible_by=None,
                   num_layers=2, hidden_size=32, seq_length=16, micro_batch_size=1,
                   global_batch_size=8, train_iters=4, lr="3e-3")
SHARES = r"data-parallel shares \(micro-batches per DP rank\): \[(\d+), (\d+)\]"


def torchrun(*flags, slow_rank=None) -> str:
    """pretrain_gpt.py on 2 ranks; `slow_rank` sleeps 50 ms before every forward."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    script = "pretrain_gpt.py"
    if slow_rank is not None:
        env.update(MEGALITE_TEST_SLOW_RANK=str(slow_rank), MEGALITE_TEST_SLOW_SECONDS="0.05")
        script = "tests/distributed/slow_rank_pretrain.py"
    proc = subprocess.run(torchrun_command(2, script, [*FLAGS, *flags]), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def losses(out: str) -> dict[int, float]:
    return {log["iteration"]: float(log["lm_loss"]) for log in parse_log(out)}


def test_auto_shares_on_a_slow_rank_and_resume_in_one_process(tmp_path, capsys):
    """--data-parallel-shares auto with rank 1 slowed: the shares move to rank 0 and every
    loss is one process's; its checkpoint of iteration 3 resumed in one process (another
    layout: the consumed samples, not the shares, place the data) gives iteration 4's."""
    assert pretrain(FLAGS) == 0
    single = losses(capsys.readouterr().out)
    save = tmp_path / "ckpt"
    out = torchrun("--data-parallel-shares", "auto", "--data-parallel-shares-window", "1",
                   "--save", str(save), "--save-interval", "3", slow_rank=1)
    shares = [tuple(map(int, s)) for s in re.findall(SHARES, out)]
    assert shares[0] == (4, 4) and shares[-1][0] > shares[-1][1], shares
    auto = losses(out)
    (save / TRACKER_FILENAME).write_text("3")  # iteration 3, not the final save
    assert pretrain([*FLAGS, "--load", str(save)]) == 0
    resumed = losses(capsys.readouterr().out)
    assert sorted(auto) == [1, 2, 3, 4] and sorted(resumed) == [4]
    for run in (auto, resumed):
        for i, loss in run.items():
            assert abs(loss - single[i]) <= 2e-6 * single[i], (i, run, single)
