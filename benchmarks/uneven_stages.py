"""Uneven pipeline stages for a model whose output layer and loss outweigh a layer (issue
29): the simulator's step and idle fraction with the even split and with
--decoder-last-pipeline-num-layers, next to the step time measured on PP 2.

The model: 6 layers of h=128, s=64, vocabulary 8192. Per token a layer costs about
24 h^2 + 4 s h multiply-adds and the output layer 2 h V (forward; backward twice each), so
the output layer and loss weigh V / (12 h + 2 s) = 4.9 layers. The even split 3 | 3 gives
the last stage 7.9 layers of work to the first's 3; 5 | 1 gives 5 | 5.9. The simulator runs
1F1B's action lists with each stage's work (simulate.stage_work), then two ranks run
each split's real step (StepRunner.train_step, with the optimizer), taking turns for
--steps rounds after a warm-up one; the fastest round of the slower rank is reported.
Two ranks that share loaded CPU cores run one after the other whatever the split (the
total work is the same); --loss-delay-ms makes the last stage heavier with a sleep, which
leaves the CPU to the other rank, as a stage on its own device would.

    python benchmarks/uneven_stages.py [--device cpu|cuda] [--steps 5] [--loss-delay-ms 0]

SMOKE=1: one timed round per split (CPU ranks forked).
"""

import argparse
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist

from benchmarks.common.rank_setup import (add_device_flag, describe, launch, rank_device,
                                          require_ranks, slow_down, synced_clock)
from benchmarks.common.smoke import shrink
from megalite.config import (CheckpointConfig, Config, DistributedConfig, GPTConfig,
                             LoggingConfig, OptimizerConfig, ParallelConfig, PrecisionConfig,
                             TrainingConfig)
from megalite.model.gpt import build_model_chunks
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.pipeline_parallel.schedules import build_schedule
from megalite.pipeline_parallel.simulate import simulate, stage_work
from megalite.pipeline_parallel.stages import stage_layer_counts
from megalite.train_step import StepRunner

PP, LAYERS, HIDDEN, SEQ, MICRO, NUM_MICRO, VOCAB = 2, 6, 128, 64, 2, 8, 8192
LOSS_LAYERS = VOCAB / (12 * HIDDEN + 2 * SEQ)
SPLITS = {"even 3 | 3": None,
          "--decoder-last-pipeline-num-layers 1: 5 | 1": stage_layer_counts(LAYERS, PP, last=1)}



def _runner(counts, state, device):
    config = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN,
                       num_attention_heads=8, num_query_groups=8, kv_channels=HIDDEN // 8,
                       seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB,
                       attention_dropout=0.0, hidden_dropout=0.0, attention_backend="sdpa")
    chunks = build_model_chunks(config, 1, state.pp_rank, PP, 1, layer_counts=counts).to(device)
    optimizer = Optimizer(chunks, OptimizerConfig(lr=1e-4), model_parallel_group=state.mp_group)
    run = Config(model=config, parallel=ParallelConfig(pipeline_layer_counts=counts),
                 training=TrainingConfig(micro_batch_size=MICRO, num_microbatches=NUM_MICRO,
                                         global_batch_size=MICRO * NUM_MICRO),
                 precision=PrecisionConfig(), logging=LoggingConfig(),
                 distributed=DistributedConfig(), checkpoint=CheckpointConfig(check_for_nan=False))
    return StepRunner(chunks, optimizer, run, state, device)



def worker(rank, world, device_type, steps, loss_delay):
    device = rank_device(rank, device_type)
    state = ParallelState(RankGrid(world, 1, PP), rank)
    gen = torch.Generator().manual_seed(0)
    batch = [{"tokens": torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen).to(device),
              "labels": torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen).to(device),
              "loss_mask": torch.ones(MICRO, SEQ, device=device)} for _ in range(NUM_MICRO)]
    runners = {name: _runner(counts, state, device) for name, counts in SPLITS.items()}
    if loss_delay and state.pp_rank == PP - 1:  # the loss's stage made heavier (test-only)
        for runner in runners.values():
            slow_down(runner.chunks[-1], loss_delay)
    times = {name: [] for name in SPLITS}
    for _ in range(steps + 1):  # round robin: a change in load hits both splits alike
        for name, runner in runners.items():
            dist.barrier()
            t0 = synced_clock(device)
            runner.train_step(batch)
            slowest = torch.tensor([synced_clock(device) - t0], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[name].append(slowest.item())
    return {name: min(t[1:]) for name, t in times.items()}


def simulated(counts):
    """(step in layer-forward units, idle fraction) of 1F1B with each stage's work."""
    counts = counts or stage_layer_counts(LAYERS, PP, first=LAYERS // PP)  # the even split
    sim = simulate([build_schedule(PP, r, NUM_MICRO) for r in range(PP)], 1, 1, 2,
                   work_per_stage=stage_work(counts, 0, LOSS_LAYERS))
    return sim.makespan, float(sim.idle_fraction)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_flag(parser)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per split")
    parser.add_argument("--loss-delay-ms", type=float, default=0.0,
                        help="a test-only sleep before each forward of the last stage: a "
                             "heavier loss that does not compete for the CPU")
    args = shrink(parser.parse_args(), steps=1)
    require_ranks(args.device, PP)
    measured = launch(PP, worker, args.device, args.steps, args.loss_delay_ms / 1e3,
                      device_type=args.device)[0]
    print(f"PP={PP}, {LAYERS} layers (h={HIDDEN}, s={SEQ}, b={MICRO}, V={VOCAB}: output "
          f"layer and loss = {LOSS_LAYERS:.1f} layers), m={NUM_MICRO}, 1F1B, fp32, on "
          f"{describe(args.device)}; last stage sleeps {args.loss_delay_ms:g} ms per forward")
    print(f"{'split':>44} {'sim. step':>10} {'sim. idle':>10} {'measured ms':>12}")
    for name, counts in SPLITS.items():
        step, idle = simulated(counts)
        print(f"{name:>44} {step:>10.1f} {idle:>10.3f} {measured[name] * 1e3:>12.1f}")
    even, uneven = (measured[name] for name in SPLITS)
    print(f"measured speed-up of the uneven split: {even / uneven:.2f}x (simulated "
          f"{simulated(None)[0] / simulated(SPLITS[list(SPLITS)[1]])[0]:.2f}x)")


if __name__ == "__main__":
    main()
