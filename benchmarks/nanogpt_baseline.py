"""megalite against a plain PyTorch training loop of the same model, alternately on the CPU.

The model is nanoGPT's baby configuration (its shakespeare_char example: 4 layers, 4 heads,
128 wide, block 64, batch 12, vocabulary 65, no bias, no dropout; AdamW lr 1e-3 cosine to
1e-4 after 100 warm-up iterations, beta2 0.99, weight decay 0.1, clip 1.0). megalite runs as
a user runs it, `pretrain_gpt.py` on --mock-data, one process; the plain loop is nanoGPT's
model.py and train.py condensed (fp32 on a CPU, as nanoGPT runs there) on random tokens.
(megalite keeps its LayerNorm biases, 1,152 of 0.8M parameters: it has no flag to drop them.)
Runs alternate, in ABBA order (megalite, plain; plain, megalite; ...), so that a busy machine
slows both alike; each reports its mean time per iteration after the first log interval
(start-up).

    python benchmarks/nanogpt_baseline.py [--iters 400] [--rounds 3] [--threads 2]

Prints each run's tokens/s, each round's megalite / plain, the median of each side and their
ratio, and the median of the rounds' ratios (rounds pair runs close in time).
SMOKE=1 (benchmarks/common/smoke.py): one round of 4 iterations per side, 1 thread, not a
measurement.
"""

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common.smoke import shrink
from megalite.host_memory import MMAP_THRESHOLD, NEVER_TRIM
from megalite.training_log import parse_log

ROOT = Path(__file__).resolve().parent.parent
LAYERS, HEADS, WIDTH, BLOCK, BATCH, VOCAB = 4, 4, 128, 64, 12, 65
LR, MIN_LR, WARMUP = 1e-3, 1e-4, 100
# megalite's own malloc setting (host_memory.keep_freed_host_memory), as glibc reads it from
# the environment: for --plain-keeps-freed-memory.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
              "MALLOC_TRIM_THRESHOLD_": str(NEVER_TRIM)}

MEGALITE_FLAGS = [
    "--mock-data", "--vocab-size", VOCAB, "--make-vocab-size-divisible-by", 1,
    "--num-layers", LAYERS, "--hidden-size", WIDTH, "--num-attention-heads", HEADS,
    "--seq-length", BLOCK, "--max-position-embeddings", BLOCK, "--micro-batch-size", BATCH,
    "--global-batch-size", BATCH, "--lr", LR, "--min-lr", MIN_LR, "--lr-decay-style",
    "cosine", "--adam-beta2", 0.99, "--weight-decay", 0.1,
    "--clip-grad", 1.0, "--disable-bias-linear", "--attention-dropout", 0,
    "--hidden-dropout", 0, "--eval-iters", 0, "--num-workers", 0,
    "--distributed-backend", "gloo"]


# --- the plain loop: nanoGPT's model and training step ---------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH, bias=False), nn.LayerNorm(WIDTH, bias=False)
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.attn_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.mlp_proj = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH, bias=False)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in nanoGPT and megalite's default
        for p in self.parameters():
            nn.init.normal_(p, std=0.02) if p.dim() == 2 else None

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def warmup(iters: int) -> int:
    """nanoGPT's 100 warm-up iterations, fewer in a short run (the decay must follow)."""
    return min(WARMUP, iters // 4)


def plain_lr(it: int, iters: int) -> float:
    w = warmup(iters)
    if it < w:
        return LR * (it + 1) / (w + 1)
    ratio = min(1.0, (it - w) / max(1, iters - w))
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def plain_loop(iters: int, interval: int) -> list[float]:
    """nanoGPT's train.py step; the mean ms/iteration of each log interval."""
    torch.manual_seed(1337)
    data = torch.randint(0, VOCAB, (1_000_000,))
    model = PlainGPT()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.99))
    means, start = [], time.perf_counter()
    for it in range(iters):
        ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))
        x = torch.stack([data[i:i + BLOCK] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])
        for group in optimizer.param_groups:
            group["lr"] = plain_lr(it, iters)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (it + 1) % interval == 0:
            loss.item()  # nanoGPT reads the loss when it logs
            now = time.perf_counter()
            means.append(1000 * (now - start) / interval)
            start = now
    return means


# --- the alternating runs ---------------------------------------------------------------------

def run_megalite(iters: int, interval: int, env: dict) -> float:
    argv = [sys.executable, str(ROOT / "pretrain_gpt.py"), *map(str, MEGALITE_FLAGS),
            "--train-iters", str(iters), "--log-interval", str(interval),
            "--lr-warmup-iters", str(warmup(iters))]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"megalite run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    means = [log["elapsed_ms"] for log in parse_log(done.stdout)]
    return statistics.mean(means[1:])


def run_plain(iters: int, interval: int, env: dict) -> float:
    argv = [sys.executable, __file__, "--plain-loop", "--iters", str(iters)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--iters", type=int, default=400, help="iterations per run (default 400)")
    p.add_argument("--rounds", type=int, default=3, help="megalite + plain pairs (default 3)")
    p.add_argument("--threads", type=int, default=2, help="OMP threads per run (default 2)")
    p.add_argument("--plain-keeps-freed-memory", action="store_true",
                   help="give the plain loop megalite's malloc setting too (host_memory.py), "
                        "through glibc's MALLOC_* variables")
    p.add_argument("--plain-loop", action="store_true", help=argparse.SUPPRESS)
    args = shrink(p.parse_args(), iters=4, rounds=1, threads=1)
    interval = max(1, args.iters // 4)
    if args.plain_loop:  # a child process: print the mean ms/iteration after start-up
        print(statistics.mean(plain_loop(args.iters, interval)[1:]))
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    plain_env = dict(env, **MALLOC_ENV) if args.plain_keeps_freed_memory else env
    tokens = BATCH * BLOCK
    results = {"megalite": [], "plain": []}
    print(f"nanoGPT baby config, {args.iters} iterations per run, {args.threads} threads, "
          f"torch {torch.__version__}")
    sides = (("megalite", run_megalite), ("plain", run_plain))
    for r in range(args.rounds):
        # ABBA: each side goes first in every other round, so a machine slowing down or
        # speeding up over the session does not favour the side that always runs first.
        for name, run in sides if r % 2 == 0 else sides[::-1]:
            ms = run(args.iters, interval, env if name == "megalite" else plain_env)
            results[name].append(tokens / ms * 1000)
            print(f"round {r + 1} {name:8s}: {ms:7.1f} ms/iteration, "
                  f"{results[name][-1]:9.0f} tokens/s", flush=True)
        print(f"round {r + 1} megalite / plain = "
              f"{results['megalite'][-1] / results['plain'][-1]:.2f}x", flush=True)
    ours, plain = (statistics.median(results[k]) for k in ("megalite", "plain"))
    ratios = [a / b for a, b in zip(results["megalite"], results["plain"])]
    print(f"median tokens/s: megalite {ours:.0f}, plain PyTorch {plain:.0f}, "
          f"megalite / plain = {ours / plain:.2f}x; median of the rounds' ratios "
          f"{statistics.median(ratios):.2f}x (from {min(ratios):.2f} to {max(ratios):.2f})")


if __name__ == "__main__":
    main()
