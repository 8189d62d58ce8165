"""Single-process training speed of a small GPT, next to the machine's matmul peak.

Reports tokens/s and achieved FLOP/s (Megatron's count, megalite.training_log) of full
training steps (forward, backward, AdamW), and, measured in the same run, the fp32 (and
bf16) GEMM FLOP/s of this machine on a square matmul: the physical limit a training step
could approach.

    python benchmarks/train_throughput.py [--hidden-size 256 --num-layers 4 ...]
"""

import argparse
import time

import torch

from megalite.config import OptimizerConfig
from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.optimizer.optimizer import Optimizer
from megalite.training_log import num_floating_point_operations


def matmul_flops(n: int, dtype: torch.dtype, seconds: float = 2.0) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    return 2 * n ** 3 * iters / (time.perf_counter() - start)


def train_flops(config: GPTConfig, batch: int, steps: int, bf16: bool) -> tuple[float, float]:
    """(tokens/s, FLOP/s) over `steps` timed steps after 3 warm-up steps."""
    model = GPTModel(config, seed=1)
    opt = Optimizer(model, OptimizerConfig(lr=1e-4))
    tokens = torch.randint(0, config.padded_vocab_size, (batch, config.seq_length + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(inputs, labels).mean()
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = (time.perf_counter() - start) / steps
    flops = num_floating_point_operations(config, batch)
    return batch * config.seq_length / elapsed, flops / elapsed


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--bf16", action="store_true",
                   help="Also time bf16 autocast (slow on CPUs without AVX512-BF16/AMX).")
    args = p.parse_args()
    h = args.hidden_size
    config = GPTConfig(
        num_layers=args.num_layers, hidden_size=h, ffn_hidden_size=4 * h,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_attention_heads,
        kv_channels=h // args.num_attention_heads, seq_length=args.seq_length,
        max_position_embeddings=args.seq_length, padded_vocab_size=args.vocab_size,
        attention_dropout=0.0, hidden_dropout=0.0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model: "
          f"{args.num_layers} layers, hidden {h}, seq {args.seq_length}, micro batch "
          f"{args.micro_batch_size}, vocab {args.vocab_size}, "
          f"{sum(p.numel() for p in GPTModel(config, 1).parameters()) / 1e6:.2f}M params")
    peak32 = matmul_flops(2048, torch.float32)
    print(f"reference: fp32 matmul 2048^3 {peak32 / 1e9:8.1f} GFLOP/s")
    runs = [("fp32", False, peak32)]
    if args.bf16:
        peak16 = matmul_flops(512, torch.bfloat16)
        print(f"reference: bf16 matmul  512^3 {peak16 / 1e9:8.1f} GFLOP/s")
        runs.append(("bf16 autocast", True, peak16))
    for name, bf16, peak in runs:
        tps, flops = train_flops(config, args.micro_batch_size, args.steps, bf16)
        print(f"megalite train step, {name:13s}: {tps:9.0f} tokens/s  {flops / 1e9:8.1f} "
              f"GFLOP/s  = {100 * flops / peak:5.1f}% of the {name.split()[0]} matmul peak")


if __name__ == "__main__":
    main()
