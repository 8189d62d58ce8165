"""Measured pipeline time per step of PP 2 with each --pipeline-schedule, next to the
simulator's prediction from the measured F, B and W times (issue 16).

Two ranks (gloo on the CPU, NCCL with two GPUs) each hold one stage of a GPT. First each
schedule runs its action list with the real p2p plan (`run_schedule`, the
forward/backward part of a step, without the optimizer step), the schedules taking turns
for --steps rounds after a warm-up one; the fastest round of the slower rank (on a shared
machine the minimum is the least disturbed). Then each rank times its own stage's
passes on one micro-batch as the schedules run them: F the forward, B the backward with
the linear layers' weight gradients deferred, W the deferred weight gradients
(weight_grad.py); the fastest of --reps, averaged over the two stages (the simulator takes one
cost per pass). The prediction is the
simulated makespan of every rank's list with those costs (sends free; 1F1B and GPipe pay
B+W for their unsplit backward).

    python benchmarks/pipeline_schedules_measured.py [--device cpu|cuda] [--steps 3]

SMOKE=1: one timed round per schedule and one timed pass each of F, B, W (CPU ranks forked).
"""

import argparse
import contextlib
import sys
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist

from benchmarks.common.rank_setup import add_device_flag, describe, launch, rank_device
from benchmarks.common.smoke import shrink
from megalite.config import (CheckpointConfig, Config, DistributedConfig, GPTConfig,
                             LoggingConfig, OptimizerConfig, ParallelConfig, PrecisionConfig,
                             TrainingConfig)
from megalite.model.gpt import build_model_chunks
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.pipeline_parallel.executor import run_schedule
from megalite.pipeline_parallel.schedules import SCHEDULES, build_schedule
from megalite.pipeline_parallel.simulate import simulate
from megalite.tensor_parallel.weight_grad import WeightGradStore
from megalite.train_step import StepRunner

PP, LAYERS, HIDDEN, SEQ, MICRO, NUM_MICRO, VOCAB = 2, 4, 256, 128, 4, 8, 512


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def pass_times(chunk, microbatch, shape, device, reps) -> list[float]:
    """Seconds of this stage's F, B (weight gradients deferred) and W: the fastest of
    `reps` (on a shared machine the minimum is the least disturbed)."""
    stage = chunk.stage
    samples = []
    for _ in range(reps + 1):  # the first is a warm-up
        x = microbatch["tokens"] if stage.is_first else \
            torch.randn(shape, device=device, requires_grad=True)
        t0 = _sync(device)
        out = chunk(x, microbatch["labels"] if stage.is_last else None)
        t1 = _sync(device)
        store = WeightGradStore()
        with chunk.linear_step.defer_weight_grads(store):
            if stage.is_last:
                out.sum().backward()
            else:
                out.backward(torch.ones_like(out))
        t2 = _sync(device)
        store.run()
        t3 = _sync(device)
        samples.append((t1 - t0, t2 - t1, t3 - t2))
    return [min(s[i] for s in samples[1:]) for i in range(3)]


def worker(rank, world, device_type, steps, reps):
    device = rank_device(rank, device_type)
    state = ParallelState(RankGrid(world, 1, PP), rank)
    config = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN,
                       num_attention_heads=8, num_query_groups=8, kv_channels=HIDDEN // 8,
                       seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB,
                       attention_dropout=0.0, hidden_dropout=0.0, attention_backend="sdpa")
    chunks = build_model_chunks(config, 1, state.pp_rank, PP, 1, state.tp_group).to(device)
    optimizer = Optimizer(chunks, OptimizerConfig(lr=1e-3), model_parallel_group=state.mp_group)
    gen = torch.Generator().manual_seed(0)
    microbatches = [{"tokens": torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen).to(device),
                     "labels": torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen).to(device),
                     "loss_mask": torch.ones(MICRO, SEQ, device=device)}
                    for _ in range(NUM_MICRO)]
    shape = (SEQ, MICRO, HIDDEN)  # one micro-batch's activations, for pass_times
    training = TrainingConfig(micro_batch_size=MICRO, num_microbatches=NUM_MICRO,
                              global_batch_size=MICRO * NUM_MICRO)
    runs = {schedule: Config(model=config, parallel=ParallelConfig(pipeline_schedule=schedule),
                             training=training, precision=PrecisionConfig(),
                             logging=LoggingConfig(), distributed=DistributedConfig(),
                             checkpoint=CheckpointConfig(check_for_nan=False))
            for schedule in SCHEDULES}
    runners = {schedule: StepRunner(chunks, optimizer, run, state, device)
               for schedule, run in runs.items()}
    times = {schedule: [] for schedule in SCHEDULES}
    # Round robin, so a change in the machine's load hits every schedule alike.
    for _ in range(steps + 1):
        for schedule, runner in runners.items():
            optimizer.zero_grad()
            dist.barrier()
            runner.linear_step.install(chunks)  # the runners share the chunks
            t0 = _sync(device)
            run_schedule(runner.schedule, chunks, microbatches, runner.comm,
                         lambda losses, mb: losses.sum() / losses.numel(), lambda loss: loss,
                         contextlib.nullcontext, runner.linear_step)
            t1 = _sync(device)
            slowest = torch.tensor([t1 - t0], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[schedule].append(slowest.item())
    measured = {schedule: min(t[1:]) for schedule, t in times.items()}
    # The passes timed after the schedules, on warm allocator and caches, as they ran.
    costs = torch.tensor(pass_times(chunks[0], microbatches[0], shape, device, reps),
                         dtype=torch.float64, device=device)
    dist.all_reduce(costs)
    costs = (costs / world).tolist()  # mean over the stages
    return {"costs": costs, "measured": measured}


def predicted(schedule: str, costs) -> tuple[float, float]:
    """(makespan in seconds, bubble fraction) of every rank's list on the simulator."""
    sim = simulate([build_schedule(PP, r, NUM_MICRO, 1, schedule) for r in range(PP)], 1,
                   *costs)
    return sim.makespan, float(sim.bubble_fraction)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_flag(parser)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per schedule")
    parser.add_argument("--reps", type=int, default=10, help="timed passes for F, B, W")
    args = shrink(parser.parse_args(), steps=1, reps=1)
    if args.device == "cuda" and torch.cuda.device_count() < PP:
        raise SystemExit(f"--device cuda needs {PP} GPUs (one rank per GPU under NCCL)")
    result = launch(PP, worker, args.device, args.steps, args.reps,
                    device_type=args.device)[0]
    F, B, W = result["costs"]
    print(f"PP={PP}, {LAYERS} layers (h={HIDDEN}, s={SEQ}, b={MICRO}), m={NUM_MICRO}, fp32, "
          f"on {describe(args.device)}")
    print(f"measured per stage and micro-batch: F={F * 1e3:.1f} ms, B={B * 1e3:.1f} ms, "
          f"W={W * 1e3:.1f} ms")
    print(f"{'schedule':>8} {'measured ms':>12} {'predicted ms':>13} {'ratio':>6} "
          f"{'sim. bubble':>12}")
    for schedule in SCHEDULES:
        makespan, bubble = predicted(schedule, (F, B, W))
        ms = result["measured"][schedule] * 1e3
        print(f"{schedule:>8} {ms:>12.1f} {makespan * 1e3:>13.1f} "
              f"{ms / (makespan * 1e3):>6.3f} {bubble:>12.4f}")


if __name__ == "__main__":
    main()
