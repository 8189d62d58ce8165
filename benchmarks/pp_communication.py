"""Pipeline p2p bytes per training step, counted at the send calls, against the closed form.

Every micro-batch crosses every boundary between consecutive stages twice: its activation
[s, b, h] forward and that activation's gradient backward. With p ranks, v chunks each
(p*v stages), m micro-batches and e bytes per element:

    bytes sent per step (all ranks) = 2 * m * (p*v - 1) * s * b * h * e

(under sequence parallelism s is the shard s/TP). Interleaving (v > 1) shrinks the bubble
by v at the price of v times the boundaries (Narayanan et al. 2021, §2.2).

    python benchmarks/pp_communication.py [--device cpu|cuda]

On GPUs (--device cuda, the default when one is visible) each rank drives its own GPU over
NCCL (NCCL refuses two ranks on one GPU), so a row needs p GPUs; rows needing more than
the visible GPUs are skipped with a note. On the CPU the ranks run over gloo.
Bytes off the closed form exit non-zero. SMOKE=1 (benchmarks/common/smoke.py): p = 2 only.
"""

import argparse
import sys
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
from megalite.train_step import StepRunner

SEQ, MICRO, HIDDEN, NUM_MICRO = 64, 2, 64, 8


def worker(rank, world, pp, v, device_type):
    device = rank_device(rank, device_type)
    state = ParallelState(RankGrid(world, 1, pp), rank)
    config = GPTConfig(num_layers=8, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN,
                       num_attention_heads=4, num_query_groups=4, kv_channels=16,
                       seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=128,
                       attention_dropout=0.0, hidden_dropout=0.0, attention_backend="sdpa")
    chunks = build_model_chunks(config, 1, state.pp_rank, pp, v, state.tp_group).to(device)
    optimizer = Optimizer(chunks, OptimizerConfig(lr=1e-3), model_parallel_group=state.mp_group)
    run = Config(model=config, parallel=ParallelConfig(), precision=PrecisionConfig(),
                 training=TrainingConfig(micro_batch_size=MICRO, num_microbatches=NUM_MICRO,
                                         global_batch_size=MICRO * NUM_MICRO),
                 logging=LoggingConfig(), distributed=DistributedConfig(),
                 checkpoint=CheckpointConfig(check_for_nan=False))
    runner = StepRunner(chunks, optimizer, run, state, device)
    batch = {"tokens": torch.randint(0, 128, (MICRO, SEQ), device=device),
             "labels": torch.randint(0, 128, (MICRO, SEQ), device=device),
             "loss_mask": torch.ones(MICRO, SEQ, device=device)}
    runner.train_step([batch] * NUM_MICRO)
    sent = torch.tensor([runner.comm.bytes_sent], dtype=torch.float64, device=device)
    dist.all_reduce(sent)
    return int(sent.item())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_flag(p)
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes p")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2], help="chunks per rank v")
    args = shrink(p.parse_args(), pp=[2])
    device = args.device
    print(f"micro-batch [s={SEQ}, b={MICRO}, h={HIDDEN}] fp32, m={NUM_MICRO} micro-batches, "
          f"8 layers, on {describe(device)}")
    print(f"{'p':>2} {'v':>2} {'stages':>6} {'measured bytes':>15} {'closed form':>15} "
          f"{'ratio':>6}")
    for pp, v in ((pp, v) for pp in args.pp for v in args.chunks):
        if device == "cuda" and pp > torch.cuda.device_count():
            print(f"{pp:>2} {v:>2} skipped: needs {pp} GPUs (one rank per GPU under NCCL)")
            continue
        measured = launch(pp, worker, pp, v, device, device_type=device)[0]
        closed = 2 * NUM_MICRO * (pp * v - 1) * SEQ * MICRO * HIDDEN * 4
        print(f"{pp:>2} {v:>2} {pp * v:>6} {measured:>15,} {closed:>15,} {measured / closed:>6.3f}")
        if measured != closed:
            raise SystemExit(f"p={pp} v={v}: {measured:,} bytes sent, closed form {closed:,}")


if __name__ == "__main__":
    main()
