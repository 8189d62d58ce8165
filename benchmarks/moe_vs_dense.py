"""A small mixture of experts against the dense GPT of the same active parameters, trained for
the same steps on the same data: validation loss every --eval-interval steps.

The data is the embedded corpus (tools/build_stdlib_corpus.py: the Python standard library's
source, the quickstart's corpus), its first --max-documents documents, a SentencePiece
vocabulary of --vocab-size trained on them, preprocessed to .bin/.idx, split 95/5/0. Both
models: 2 layers, hidden 128, 4 heads, RoPE, RMSNorm, SwiGLU, no biases, sequence 64, no
dropout, AdamW lr 2e-3 cosine after a 5% warm-up, global batch 16, the same seed and
samples. The dense MLP is 256 wide; the MoE layers have 8 experts of width 128 with top-2
routing (each token's active MLP is 2 x 128 = 256 wide, the same FLOPs: 4x the MLP
parameters in total, plus the 8 x 128 router per layer), aux-loss coefficient 1e-2.

    python benchmarks/moe_vs_dense.py [--iters 600] [--eval-interval 100]

Prints a table of both validation curves. SMOKE=1 (benchmarks/common/smoke.py): --mock-data
instead of the corpus, 2 steps; not a measurement.
"""

import argparse
import contextlib
import io
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common.smoke import ON as SMOKE, shrink
from megalite.training import pretrain
from megalite.training_log import parse_validation_line

ROOT = Path(__file__).resolve().parent.parent

COMMON = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
          "--seq-length", "64", "--max-position-embeddings", "64",
          "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
          "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
          "--micro-batch-size", "16", "--global-batch-size", "16", "--lr", "2e-3",
          "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.05",
          "--weight-decay", "0.1", "--clip-grad", "1.0", "--split", "95,5,0",
          "--num-workers", "0", "--seed", "1234", "--distributed-backend", "gloo"]
MODELS = {
    "dense (MLP 256)": ["--ffn-hidden-size", "256"],
    "MoE 8 experts top-2 (width 128)": ["--ffn-hidden-size", "256", "--num-experts", "8",
                                        "--moe-router-topk", "2", "--moe-ffn-hidden-size",
                                        "128", "--moe-aux-loss-coeff", "1e-2",
                                        "--moe-grouped-gemm"],
}


def tool(name: str, *args):
    subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)], check=True,
                   stdout=subprocess.DEVNULL)


def build_data(work: Path, documents: int, vocab: int) -> list[str]:
    """The corpus, tokenizer and .bin/.idx under `work`; the data flags of pretrain_gpt.py."""
    tool("build_stdlib_corpus.py", "--output", work / "corpus.jsonl", "--max-documents",
         documents)
    tool("train_tokenizer.py", "--input", work / "corpus.jsonl", "--model-prefix",
         work / "tok", "--vocab-size", vocab)
    tool("preprocess_data.py", "--input", work / "corpus.jsonl", "--output-prefix",
         work / "stdlib", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
         work / "tok.model", "--append-eod", "--workers", "1")
    return ["--data-path", str(work / "stdlib_text_document"), "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", str(work / "tok.model"),
            "--data-cache-path", str(work / "cache")]


def train(flags: list[str]) -> tuple[dict[int, float], float]:
    """({iteration: validation loss}, seconds) of one pretrain_gpt.py run, in this process."""
    start, out = time.perf_counter(), io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pretrain(flags)
    if code:
        sys.exit(f"pretrain_gpt.py {' '.join(flags)} failed:\n{out.getvalue()[-3000:]}")
    curve = {}
    for line in out.getvalue().splitlines():
        fields = parse_validation_line(line)
        # The evaluations during training ("iteration N"), not the final ones.
        match = fields and re.fullmatch(r"iteration (\d+)", fields["prefix"])
        if match:
            curve[int(match[1])] = fields["loss"]
    return curve, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=600)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--eval-iters", type=int, default=10)
    parser.add_argument("--max-documents", type=int, default=400)
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = shrink(parser.parse_args(argv), iters=2, eval_interval=2, eval_iters=1,
                  vocab_size=512)
    with tempfile.TemporaryDirectory() as tmp:
        # SMOKE=1 skips the corpus, tokenizer and preprocessing: mock data of that vocabulary.
        data = (["--mock-data", "--vocab-size", str(args.vocab_size)] if SMOKE
                else build_data(Path(tmp), args.max_documents, args.vocab_size))
        run = ["--train-iters", str(args.iters), "--eval-interval", str(args.eval_interval),
               "--eval-iters", str(args.eval_iters), "--log-interval", str(args.eval_interval)]
        curves, seconds = {}, {}
        for name, flags in MODELS.items():
            curves[name], seconds[name] = train(COMMON + flags + data + run)
            print(f"trained {name}: {seconds[name]:.0f} s", flush=True)
    names = list(MODELS)
    print(f"{args.iters} iterations, {args.max_documents} documents, vocabulary "
          f"{args.vocab_size}; validation loss ({args.eval_iters} batches of 16) by iteration")
    print("| iteration | " + " | ".join(names) + " | MoE - dense |")
    print("|---:|" + "---:|" * (len(names) + 1))
    for it in curves[names[0]]:
        values = [curves[n].get(it, float("nan")) for n in names]
        print(f"| {it} | " + " | ".join(f"{v:.4f}" for v in values)
              + f" | {values[1] - values[0]:+.4f} |")
    print("wall time: " + ", ".join(f"{n} {s:.0f} s" for n, s in seconds.items()))
    last = max(curves[names[0]])
    lower = curves[names[1]][last] < curves[names[0]][last]
    print(f"final validation loss of the MoE is {'lower' if lower else 'NOT lower'} than the "
          "dense model's")


if __name__ == "__main__":
    main()
