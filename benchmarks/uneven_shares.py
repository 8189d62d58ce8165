"""Tokens/s of DP 2 with rank 1 slowed on purpose (a test-only delay before each
micro-batch's forward, as the --log-straggler tests slow a rank): even shares against
--data-parallel-shares auto, measured in the same run, next to the ideal, the sum of the
two ranks' own speeds (issue 29).

Each rank runs StepRunner.train_step on its share of every global batch; the shares come
from megalite's own ShareBalancer, which times each rank's compute phases (the straggler
timers) for --steps steps at even shares, all-gathers them, and splits the micro-batches
in proportion to the speeds. Then --steps steps at even shares alternate with --steps at
the auto shares (a machine whose load drifts favours neither). A rate is the global
batch's tokens over the median step time (the slower rank's); the ideal is the sum of the
ranks' measured micro-batches/s times the tokens of a micro-batch.

    python benchmarks/uneven_shares.py [--device cpu|cuda] [--steps 6] [--delay-ms 100]

SMOKE=1: one step per phase (CPU ranks forked).
"""

import argparse
import statistics
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist

from benchmarks.common.rank_setup import (add_device_flag, describe, launch, rank_device,
                                          require_ranks, slow_down, synced_clock)
from benchmarks.common.smoke import shrink
from megalite.config import (DEFAULT_BUCKET_SIZE, CheckpointConfig, Config,
                             DistributedConfig, GPTConfig, LoggingConfig, OptimizerConfig,
                             ParallelConfig, PrecisionConfig, TrainingConfig)
from megalite.data.shares import ShareBalancer
from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import build_model_chunks
from megalite.timers import COMPUTE, Timers
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.train_step import StepRunner

DP, LAYERS, HIDDEN, SEQ, MICRO, NUM_MICRO, VOCAB = 2, 2, 128, 128, 2, 16, 1024
SLOW_RANK = 1




def worker(rank, world, device_type, steps, delay):
    device = rank_device(rank, device_type)
    state = ParallelState(RankGrid(world), rank)
    config = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN,
                       num_attention_heads=8, num_query_groups=8, kv_channels=HIDDEN // 8,
                       seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB,
                       attention_dropout=0.0, hidden_dropout=0.0, attention_backend="sdpa")
    chunks = build_model_chunks(config, 1).to(device)
    if rank == SLOW_RANK:
        slow_down(chunks[0], delay)
    grad_buffer = GradBuffer(list(chunks.parameters()), state.dp_group, DEFAULT_BUCKET_SIZE)
    optimizer = Optimizer(chunks, OptimizerConfig(lr=1e-4))
    timers = Timers(0, device, extra=COMPUTE)
    run = Config(model=config, parallel=ParallelConfig(data_parallel_size=DP),
                 training=TrainingConfig(micro_batch_size=MICRO,
                                         global_batch_size=MICRO * NUM_MICRO,
                                         num_microbatches=NUM_MICRO // DP),
                 precision=PrecisionConfig(), logging=LoggingConfig(),
                 distributed=DistributedConfig(),
                 checkpoint=CheckpointConfig(check_for_nan=False))
    runner = StepRunner(chunks, optimizer, run, state, device, grad_buffer, timers)
    balancer = ShareBalancer((NUM_MICRO // DP,) * DP, state, timers, auto=True, threshold=0.2,
                             window=steps)
    gen = torch.Generator().manual_seed(0)
    batch = [{"tokens": torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen).to(device),
              "labels": torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen).to(device),
              "loss_mask": torch.ones(MICRO, SEQ, device=device)} for _ in range(NUM_MICRO)]
    iteration, times = 0, {}
    even = balancer.shares

    def step(phase: str, shares):
        nonlocal iteration
        start = sum(shares[:rank])
        dist.barrier()
        t0 = synced_clock(device)
        balancer.before_step()
        runner.train_step(batch[start:start + shares[rank]])
        slowest = torch.tensor([synced_clock(device) - t0], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        iteration += 1
        if phase in ("warm-up", "measure"):
            balancer.after_step(iteration)
        times.setdefault(phase, []).append(slowest.item())

    step("warm-up", even)  # the balancer skips the first step too
    for _ in range(steps):  # its window: the speeds, then the auto shares
        step("measure", even)
    auto = balancer.shares  # measured once; the alternation below does not re-balance
    for _ in range(steps):  # alternating, so a drift in the machine's load hits both alike
        step("even", even)
        step("auto", auto)
    tokens = NUM_MICRO * MICRO * SEQ
    rate = {phase: tokens / statistics.median(t) for phase, t in times.items()}
    return {"even": rate["even"], "auto": rate["auto"], "shares": balancer.shares,
            "ideal": sum(balancer.speeds) * MICRO * SEQ, "speeds": balancer.speeds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_flag(parser)
    parser.add_argument("--steps", type=int, default=6, help="steps per phase")
    parser.add_argument("--delay-ms", type=float, default=100.0,
                        help="sleep of the slowed rank before each micro-batch's forward")
    args = shrink(parser.parse_args(), steps=1)
    require_ranks(args.device, DP)
    r = launch(DP, worker, args.device, args.steps, args.delay_ms / 1e3,
               device_type=args.device)[0]
    print(f"DP={DP}, {LAYERS} layers (h={HIDDEN}, s={SEQ}, b={MICRO}), {NUM_MICRO} "
          f"micro-batches per step, rank {SLOW_RANK} sleeps {args.delay_ms:g} ms per "
          f"micro-batch, fp32, on {describe(args.device)}")
    print(f"measured micro-batches/s per rank: {[round(s, 1) for s in r['speeds']]}; auto "
          f"shares {list(r['shares'])}")
    print(f"{'shares':>8} {'tokens/s':>10} {'of ideal':>9}")
    for name in ("even", "auto", "ideal"):
        print(f"{name:>8} {r[name]:>10.0f} {r[name] / r['ideal']:>9.2f}")
    print(f"auto over even: {r['auto'] / r['even']:.2f}x")


if __name__ == "__main__":
    main()
