"""Single-process training speed of a GPT, next to the device's matmul peak.

Reports tokens/s and achieved FLOP/s (Megatron's count, megalite.training_log) of full
training steps (forward, backward, AdamW), and, measured in the same run, the fp32 (and
bf16) GEMM FLOP/s of this device on a square matmul: the physical limit a training step
could approach. On a GPU (--device cuda, the default when one is visible) the model is
bigger by default, bf16 autocast is always timed, fp32 matmuls run in TF32 as in
pretrain_gpt.py (megalite.initialize.allow_tf32), and every timing ends in a synchronize.

    python benchmarks/train_throughput.py [--hidden-size 256 --num-layers 4 ...]
    python benchmarks/train_throughput.py --device cpu

SMOKE=1 (benchmarks/common/smoke.py): a tiny model, two steps and 0.1 s matmuls, not a measurement.
"""

import argparse
import sys
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.common.smoke import shrink
from megalite.config import GPTConfig, OptimizerConfig
from megalite.initialize import allow_tf32
from megalite.model.gpt import GPTModel
from megalite.monitoring.peak_flops import mfu_percent
from megalite.optimizer.optimizer import Optimizer
from megalite.training_log import num_floating_point_operations


# Defaults per device: small enough for a 2-core CPU; a GPU-sized model on GPUs.
CPU_MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256,
                 micro_batch_size=8, vocab_size=8192, matmul_size=2048)
GPU_MODEL = dict(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                 micro_batch_size=4, vocab_size=32768, matmul_size=8192)


def synchronize(device: torch.device):
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def matmul_flops(n: int, dtype: torch.dtype, device: torch.device, seconds: float) -> float:
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    a @ b  # warm-up
    synchronize(device)
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1 if device.type == "cpu" else 10):
            a @ b
            iters += 1
        synchronize(device)
    return 2 * n ** 3 * iters / (time.perf_counter() - start)


def train_flops(config: GPTConfig, batch: int, steps: int, bf16: bool,
                device: torch.device) -> tuple[float, float]:
    """(tokens/s, FLOP/s) over `steps` timed steps after 3 warm-up steps."""
    model = GPTModel(config, seed=1).to(device)
    print(f"  {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on {device}")
    opt = Optimizer(model, OptimizerConfig(lr=1e-4))
    tokens = torch.randint(0, config.padded_vocab_size, (batch, config.seq_length + 1),
                           device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(inputs, labels).mean()
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    elapsed = (time.perf_counter() - start) / steps
    flops = num_floating_point_operations(config, batch)
    return batch * config.seq_length / elapsed, flops / elapsed


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default cuda when a GPU is visible).")
    for key in CPU_MODEL:
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None,
                       help=f"default {CPU_MODEL[key]} on a CPU, {GPU_MODEL[key]} on a GPU")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--matmul-seconds", type=float, default=2.0,
                   help="How long each reference matmul is timed.")
    p.add_argument("--bf16", action="store_true",
                   help="Also time bf16 autocast (always on a GPU; slow on CPUs without "
                        "AVX512-BF16/AMX).")
    args = shrink(p.parse_args(), num_layers=2, hidden_size=64, num_attention_heads=4,
                  seq_length=32, micro_batch_size=2, vocab_size=512, matmul_size=128, steps=2,
                  matmul_seconds=0.1)
    device = torch.device(args.device)
    on_gpu = device.type != "cpu"
    for key, value in (GPU_MODEL if on_gpu else CPU_MODEL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if on_gpu:
        args.bf16 = True
        allow_tf32(device)
    h = args.hidden_size
    config = GPTConfig(
        num_layers=args.num_layers, hidden_size=h, ffn_hidden_size=4 * h,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_attention_heads,
        kv_channels=h // args.num_attention_heads, seq_length=args.seq_length,
        max_position_embeddings=args.seq_length, padded_vocab_size=args.vocab_size,
        attention_dropout=0.0, hidden_dropout=0.0)
    where = (torch.cuda.get_device_name(device) if on_gpu
             else f"{torch.get_num_threads()} threads")
    print(f"torch {torch.__version__}, {where}; model: "
          f"{args.num_layers} layers, hidden {h}, seq {args.seq_length}, micro batch "
          f"{args.micro_batch_size}, vocab {args.vocab_size}")
    n32 = args.matmul_size
    n16 = n32 if on_gpu else 512  # bf16 on most CPUs is emulated: slow
    fp32 = "fp32 (TF32)" if on_gpu else "fp32"
    peak32 = matmul_flops(n32, torch.float32, device, args.matmul_seconds)
    print(f"reference: {fp32} matmul {n32}^3 {peak32 / 1e9:10.1f} GFLOP/s")
    runs = [(fp32, False, peak32)]
    if args.bf16:
        peak16 = matmul_flops(n16, torch.bfloat16, device, args.matmul_seconds)
        print(f"reference: bf16 matmul {n16}^3 {peak16 / 1e9:10.1f} GFLOP/s")
        runs.append(("bf16 autocast", True, peak16))
    for name, bf16, peak in runs:
        tps, flops = train_flops(config, args.micro_batch_size, args.steps, bf16, device)
        print(f"megalite train step, {name:13s}: {tps:9.0f} tokens/s  {flops / 1e9:8.1f} "
              f"GFLOP/s  = {mfu_percent(flops, peak):5.1f}% of the {name.split()[0]} matmul peak")


if __name__ == "__main__":
    main()
