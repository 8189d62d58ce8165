"""Routed experts as one grouped GEMM (torch._grouped_mm) against the per-expert loop, next
to the device's dense matmul peak measured in the same run.

One MoE layer's experts (SwiGLU, model/moe.py GroupedExperts), forward and backward, on T
tokens routed top-k to E experts with a skewed load (expert e gets a share proportional to
e + 1, as a router early in training does): tokens/s is T over the time of one forward and
backward; GFLOP/s counts 3 x 2 x N x (h 2F + F h) for the N = T k dispatched rows. The same
weights and rows go to both paths, whose outputs and gradients must agree (the script stops
otherwise).

    python benchmarks/moe_grouped_gemm.py [--tokens 4096] [--experts 8] [--topk 2]
        [--hidden 512] [--ffn 1024] [--repeats 5] [--rounds 3]
    python benchmarks/moe_grouped_gemm.py --device cuda          # bf16 on a GPU

Each round times the matmul and both paths, one after the other; the best round of each
is printed.
SMOKE=1 (benchmarks/common/smoke.py): 64 tokens, hidden 32, one repeat; not a measurement.
"""

import argparse
import sys
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.common.smoke import shrink
from megalite.config import GPTConfig
from megalite.expert_parallel.grouped_gemm import check_grouped_gemm_device
from megalite.model.moe import GroupedExperts
from megalite.monitoring.peak_flops import mfu_percent


def matmul_flops(n: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * n ** 3 * repeats / (time.perf_counter() - start)


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def skewed_counts(rows: int, experts: int) -> torch.Tensor:
    """Rows per expert proportional to e + 1, summing to `rows`."""
    weights = torch.arange(1, experts + 1, dtype=torch.float64)
    counts = (weights / weights.sum() * rows).floor().long()
    counts[-1] += rows - counts.sum()
    return counts


def run(args, grouped: bool, device: torch.device, dtype: torch.dtype):
    config = GPTConfig(num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                       num_attention_heads=1, num_query_groups=1, kv_channels=args.hidden,
                       seq_length=1, max_position_embeddings=1, padded_vocab_size=1,
                       swiglu=True, num_experts=args.experts, moe_ffn_hidden_size=args.ffn,
                       moe_grouped_gemm=grouped)
    torch.manual_seed(0)
    experts = GroupedExperts(config, args.experts, tp_size=1).to(device, dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    rows = args.tokens * args.topk
    counts = skewed_counts(rows, args.experts).to(device)
    x = torch.randn(rows, args.hidden, device=device, dtype=dtype, generator=None)

    def step():
        experts.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        out = experts(xi, counts)
        out.float().square().mean().backward()
        return out, xi.grad, [p.grad for p in experts.parameters()]

    result = step()  # warm-up
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.repeats):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / args.repeats
    flops = 3 * 2 * rows * (args.hidden * 2 * args.ffn + args.ffn * args.hidden)
    return seconds, flops, result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = shrink(parser.parse_args(argv), tokens=64, hidden=32, ffn=64, repeats=1, rounds=1)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    n = 1024 if device.type == "cpu" else 8192
    print(f"device {device}, {dtype}, {torch.get_num_threads()} threads; experts {args.experts}"
          f" top {args.topk}, hidden {args.hidden}, ffn {args.ffn} (SwiGLU), {args.tokens} "
          f"tokens, rows per expert {skewed_counts(args.tokens * args.topk, args.experts).tolist()}")
    note = check_grouped_gemm_device(device, dtype)  # the run's own check: refuses or notes
    if note:
        print(note)
    results, best, peak = {}, {}, 0.0
    paths = (("per-expert loop", False), ("grouped GEMM", True))
    for _ in range(args.rounds):  # alternately, so that a busy machine slows both alike
        peak = max(peak, matmul_flops(n, dtype, device, args.repeats))
        for name, grouped in paths:
            seconds, flops, results[name] = run(args, grouped, device, dtype)
            best[name] = min(seconds, best.get(name, seconds))
    print(f"reference: dense matmul {n}^3 {peak / 1e9:10.1f} GFLOP/s (best of {args.rounds})")
    for name, seconds in best.items():
        print(f"{name:16s} {args.tokens / seconds:12.0f} tokens/s  {flops / seconds / 1e9:10.1f}"
              f" GFLOP/s = {mfu_percent(flops / seconds, peak):5.1f}% of the matmul peak (best of "
              f"{args.rounds} rounds)")
    loop, grouped = results.values()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip([loop[0], loop[1], *loop[2]], [grouped[0], grouped[1], *grouped[2]]):
        torch.testing.assert_close(b.float(), a.float(), rtol=tolerance, atol=tolerance)
    print("outputs and gradients of both paths agree")


if __name__ == "__main__":
    main()
