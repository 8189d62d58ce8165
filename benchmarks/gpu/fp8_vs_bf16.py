"""fp8_vs_bf16.py WORKDIR ITERS [--fit FRACTION [--max-layers N]] -- PRETRAIN_GPT_FLAGS...:
the same model, data and steps in bf16 and with --fp8-format hybrid: tokens/s of each, their
ratio (goal >= 1.3x on an H100), and the loss at the end (the mean of the last three logged
intervals; FP8 within 1% of bf16, else exit 1).

The data is a synthetic corpus written here (seeded): a walk over 1024 of the V token ids
(a random subset), position p+1 = p + d mod 1024 with d drawn from a skewed distribution
over 16 offsets, so the loss falls from log V through log 1024 (which tokens occur) toward
the offsets' entropy (~2 nats) within a few hundred steps and stays far from zero, where a
relative comparison means something. (Mock data's counting documents are learnt to ~0; a
walk over all 32000 ids was not learnt at all in 300 steps: both runs ended at log V.)
With --fit, the number of transformer layers is the largest the memory planner puts within
FRACTION of this GPU (the larger of the bf16 and FP8 plans), at most N with --max-layers.
Each run goes through run_pretrain.py (compile backend and all) and its log is kept in
WORKDIR. Lines starting with ">>" are the results.
"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import numpy as np
import torch

from benchmarks.gpu.runs import planned_bytes, run_script
from megalite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megalite.training_log import parse_log


HERE = os.path.dirname(os.path.abspath(__file__))
FP8 = ["--fp8-format", "hybrid"]


def flag_value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


WALK = 1024  # token ids the walk visits


def write_corpus(prefix: str, vocab: int, tokens: int, seed: int = 1234):
    """tokens ids of a shifted random walk over WALK of the vocab's ids, in documents of
    4096."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(vocab)[:min(WALK, vocab)]
    offsets = rng.permutation(len(ids))[:16]
    weights = 1.0 / np.arange(1, 17) ** 1.5
    steps = rng.choice(offsets, size=tokens, p=weights / weights.sum())
    stream = ids[np.cumsum(steps) % len(ids)]
    dtype = best_dtype(vocab)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype, vocab_size=vocab)
    for start in range(0, tokens, 4096):
        builder.add_document(stream[start:start + 4096].astype(dtype))
    builder.finalize(prefix + ".idx")


def fit_layers(flags: list[str], fraction: float, most: int) -> int:
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    fits = 1
    for layers in range(1, most + 1):
        plans = [planned_bytes(flags + extra + ["--num-layers", str(layers)]) / 2**30
                 for extra in ([], FP8)]
        if max(plans) > fraction * gib:
            break
        fits = layers
    print(f">> {fits} layers fit within {fraction:.0%} of {gib:.0f} GiB (memory planner)"
          + (f", at most {most} asked for" if fits == most else ""))
    return fits


def run(workdir: str, name: str, flags: list[str], runner: list[str]) -> list[dict]:
    log = os.path.join(workdir, f"fp8_{name}.log")
    rc = run_script(log, os.path.join(HERE, "run_pretrain.py"), [*runner, "--", *flags])
    text = open(log, errors="replace").read()
    if rc != 0:
        print(text[-3000:])
        sys.exit(f">> the {name} run failed (exit {rc}); log {log}")
    return parse_log(text)


def main():
    argv = sys.argv[1:]
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("iters", type=int)
    p.add_argument("--fit", type=float, default=None)
    p.add_argument("--max-layers", type=int, default=64)
    p.add_argument("--compile-backend", default=None)
    args, flags = p.parse_args(argv[:split]), argv[split + 1:]
    vocab = int(flag_value(flags, "--vocab-size"))
    tokens = (args.iters + 2) * int(flag_value(flags, "--global-batch-size")) \
        * (int(flag_value(flags, "--seq-length")) + 1)
    # The corpus and its index cache go with the directory: not for the logs' archive.
    with tempfile.TemporaryDirectory(dir=args.workdir) as data:
        prefix = os.path.join(data, "corpus")
        write_corpus(prefix, vocab, int(tokens * 1.05) + 8192)
        flags += ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--split",
                  "100,0,0", "--data-cache-path", data, "--train-iters", str(args.iters),
                  "--log-interval", str(max(1, args.iters // 30))]
        if args.fit is not None:
            flags += ["--num-layers", str(fit_layers(flags, args.fit, args.max_layers))]
        runner = ["--compile-backend", args.compile_backend] if args.compile_backend else []
        logs = {name: run(args.workdir, name, flags + extra, runner)
                for name, extra in (("bf16", []), ("fp8", FP8))}
    report(logs)


def report(logs: dict[str, list[dict]]):
    speed, loss = {}, {}
    for name, log in logs.items():
        speed[name] = statistics.median(entry["tokens_per_second"] for entry in log[1:] or log)
        loss[name] = statistics.mean(entry["lm_loss"] for entry in log[-3:])
        print(f">> {name}: {speed[name]:,.0f} tokens/s (median of the logged intervals after "
              f"the first); loss {log[0]['lm_loss']:.4f} at iteration {log[0]['iteration']}, "
              f"{loss[name]:.4f} at the end (mean of the last 3 intervals)")
    ratio, gap = speed["fp8"] / speed["bf16"], loss["fp8"] / loss["bf16"] - 1
    print(f">> FP8 / bf16 tokens/s: {ratio:.2f}x (goal >= 1.3x on an H100); FP8 loss "
          f"{100 * gap:+.2f}% of bf16's at the end (bound +-1%)")
    if not all(np.isfinite(list(loss.values()))) or abs(gap) > 0.01:
        sys.exit(">> FP8's loss is not within 1% of bf16's")


if __name__ == "__main__":
    main()
