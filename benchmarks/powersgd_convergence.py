"""Convergence and bytes of PowerSGD (--grad-compression powersgd) against uncompressed DP.

One tiny GPT (2 layers, hidden 128, 4 heads, sequence 64, vocabulary 128) trained on the
same data (--mock-data: counting sequences, learnable; or, with --data-path, real text: the
quick start's embedded corpus and its tokenizer's vocabulary) at DP 4 for the same iterations,
uncompressed and with PowerSGD at ranks 1, 2, 4 and 8 (compression from
--powersgd-start-iter on, error feedback and warm start on). All variants run in one launch
of 4 processes (megalite.spawn), built from pretrain_gpt.py's flags as training builds them
(layout_check.build_run), stepped with the LR schedule the flags give.

Per variant: the bytes this rank put into the DP collectives in a compressed step (counted
at the collectives, GradBuffer.bytes_sent) next to the uncompressed run's, measured in the
same run, their ratio, the mean time per step, and the validation loss (--eval-iters
batches of the validation split) after the last step and halfway, each with its difference
from uncompressed. Writes a plot of
validation loss against bytes sent per step when matplotlib (the `plot` extra) is installed.

    python benchmarks/powersgd_convergence.py [--iters 600] [--ranks 1 2 4 8] [--png FILE]
        [--start-iter 10] [--data-path PREFIX --tokenizer-model MODEL]

SMOKE=1 (benchmarks/common/smoke.py): 3 iterations, compression from iteration 2, rank 2 only,
not a measurement.
"""

import argparse
import os
import sys
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.common.smoke import shrink
from megalite.data.datasets import build_datasets
from megalite.data.loader import microbatches
from megalite.layout_check import build_run
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.spawn import run_distributed

DP = 4
MOCK = ["--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "128"]
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "8",
         "--global-batch-size", "32", "--lr", "3e-3", "--min-lr", "3e-4",
         "--lr-decay-style", "cosine", "--clip-grad", "1.0",
         "--weight-decay", "0.1", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--seed", "1234"]


def data_flags(args) -> list[str]:
    """--mock-data, or the embedded corpus (examples/quickstart.sh builds it) and its
    SentencePiece tokenizer (build_run builds no tokenizer: its vocabulary is passed)."""
    if args.data_path is None:
        return MOCK
    import sentencepiece
    vocab = sentencepiece.SentencePieceProcessor(model_file=args.tokenizer_model).vocab_size()
    return ["--data-path", args.data_path, "--split", "98,2,0", "--vocab-size", str(vocab),
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
            args.tokenizer_model, "--data-cache-path", args.data_path + "_cache"]


def variant_flags(args, rank: int | None) -> list[str]:
    flags = data_flags(args) + MODEL + ["--train-iters", str(args.iters), "--eval-iters",
                                        str(args.eval_iters),
                                        "--lr-warmup-iters", str(args.iters // 15)]
    if rank is None:
        return flags
    return flags + ["--grad-compression", "powersgd", "--powersgd-rank", str(rank),
                    "--powersgd-start-iter", str(args.start_iter)]


def train(rank_of_process: int, flags: list[str]) -> dict:
    """One variant on this process: bytes per step, seconds per step, final val loss."""
    device = torch.device("cpu")
    config, state, model, optimizer, runner, batches = build_run(flags, DP, rank_of_process,
                                                                 device)
    scheduler = LRScheduler(optimizer, config.scheduler)
    t = config.training
    valid_ds = build_datasets(config, None, is_builder=True, barrier=lambda: None)[1]
    sent, seconds, half = [], 0.0, None
    for i in range(t.train_iters):
        start = time.perf_counter()
        result = runner.train_step([next(batches) for _ in range(t.num_microbatches)])
        if not result.skipped:
            scheduler.step(t.global_batch_size)
        seconds += time.perf_counter() - start
        sent.append(runner.grad_buffer.bytes_sent)
        if i + 1 == t.train_iters // 2:
            half = validation_loss(runner, valid_ds, config, state, device)
    return {"bytes_last": sent[-1], "bytes_mean": sum(sent) / len(sent),
            "seconds": seconds / t.train_iters, "half_val_loss": half,
            "val_loss": validation_loss(runner, valid_ds, config, state, device),
            "ratio": runner.grad_buffer.compression_ratio}


def validation_loss(runner, valid_ds, config, state, device) -> float:
    """The mean loss over the first --eval-iters batches of the validation split (the same
    batches at every call)."""
    t = config.training
    valid = microbatches(valid_ds, 0, config, state, device)
    loss_sum = tokens = 0.0
    for _ in range(t.eval_iters):
        s, n = runner.evaluate([next(valid) for _ in range(t.num_microbatches)])
        loss_sum, tokens = loss_sum + s, tokens + n
    return loss_sum / tokens


def all_variants(rank, world_size, args):
    results = {}
    for name, r in variants(args):
        results[name] = train(rank, variant_flags(args, r))
        if rank == 0:
            print(f"  {name}: {results[name]}", flush=True)
    return results


def variants(args):
    return [("uncompressed", None)] + [(f"PowerSGD rank {r}", r) for r in args.ranks]


def plot(results: dict, path: str):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install megalite[plot]): no {path}")
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, r in results.items():
        ax.scatter(r["bytes_last"] / 2**10, r["val_loss"], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per step per rank (KiB, log)")
    ax.set_ylabel("final validation loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path + ".tmp.png")
    os.replace(path + ".tmp.png", path)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=600)
    parser.add_argument("--start-iter", type=int, default=10)
    parser.add_argument("--eval-iters", type=int, default=20)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--data-path", default=None,
                        help="A preprocessed corpus (prefix of .bin/.idx) instead of "
                        "--mock-data, e.g. the quick start's data/stdlib/stdlib_text_document")
    parser.add_argument("--tokenizer-model", default=None,
                        help="Its SentencePiece model (with --data-path)")
    parser.add_argument("--png", default=os.path.join(os.environ.get("OUT", "."),
                                                      "powersgd_convergence.png"),
                        help="The plot (default $OUT/, else ./powersgd_convergence.png).")
    args = shrink(parser.parse_args(), iters=3, start_iter=1, eval_iters=1, ranks=[2])
    if (args.data_path is None) != (args.tokenizer_model is None):
        parser.error("--data-path and --tokenizer-model go together")
    results = run_distributed(DP, all_variants, args, timeout=None)[0]
    base = results["uncompressed"]
    print(f"DP {DP}, {args.iters} iterations, PowerSGD from iteration {args.start_iter + 1}, "
          f"{args.data_path or 'mock data'}")
    print(f"{'variant':>18} | {'bytes/step/rank':>15} | {'vs uncompressed':>15} | "
          f"{'s/step':>7} | {'val loss':>9} | {'vs uncompressed':>15} | "
          f"{'at iters/2':>10} | {'vs uncompressed':>15}")
    for name, r in results.items():
        print(f"{name:>18} | {r['bytes_last']:>15,d} | "
              f"{base['bytes_last'] / r['bytes_last']:>14.1f}x | {r['seconds']:>7.3f} | "
              f"{r['val_loss']:>9.4f} | {100 * (r['val_loss'] / base['val_loss'] - 1):>+14.2f}% | "
              f"{r['half_val_loss']:>10.4f} | "
              f"{100 * (r['half_val_loss'] / base['half_val_loss'] - 1):>+14.2f}%")
    plot(results, args.png)


if __name__ == "__main__":
    main()
