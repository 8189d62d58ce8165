"""The zero-bubble split backward (tensor_parallel/weight_grad.py) on this device, by hand:
two micro-batches as F F B B W W (each B under the model's LinearStep.defer_weight_grads,
each W its store's run) against F F and one ordinary backward per micro-batch (with --fp8,
FP8 linears: --fp8-format hybrid, their W pass quantizing the saved input and the output
gradient). pretrain's model (--bf16: bf16 parameters, fp32 main_grad in the gradient
buffer, overlapped reduction counting each gradient's arrival); every main_grad must be
bit-equal, deterministic kernels on. The
ordinary run is repeated first: if the device itself is not deterministic here, that is
said rather than blamed on the split. Then the passes are timed: B, W, and the ordinary
backward they replace (median of a few steps, device synchronised around each pass).
"""

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.gpu.runs import GPU, Checks  # noqa: E402
from megalite.arguments import parse_args  # noqa: E402
from megalite.distributed.grad_buffer import GradBuffer  # noqa: E402
from megalite.parallel_state import ParallelState, RankGrid  # noqa: E402
from megalite.tensor_parallel.random import build_rng_tracker  # noqa: E402
from megalite.tensor_parallel.weight_grad import LinearStep, WeightGradStore  # noqa: E402
from megalite.train_step import autocast  # noqa: E402
from megalite.training import build_model  # noqa: E402
from megalite.validation import validate_args  # noqa: E402

DEVICE = torch.device("cuda" if GPU else "cpu")
# 24 layers, as the count of W-pass autograd calls; TinyLlama's layer kinds.
LAYERS, HIDDEN, HEADS, FFN, SEQ, MICRO, VOCAB = ((24, 1024, 16, 2816, 1024, 4, 32000) if GPU
                                                 else (2, 32, 4, 64, 32, 2, 256))
FLAGS = ["--mock-data", "--vocab-size", str(VOCAB), "--num-layers", str(LAYERS),
         "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
         "--group-query-attention", "--num-query-groups", str(HEADS // 4),
         "--ffn-hidden-size", str(FFN), "--seq-length", str(SEQ),
         "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(MICRO),
         "--global-batch-size", str(2 * MICRO), "--train-iters", "1", "--lr", "1e-4", "--bf16",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--attention-dropout", "0", "--hidden-dropout", "0"]
FP8 = ["--fp8-format", "hybrid"] if "--fp8" in sys.argv[1:] else []
LINEAR_WEIGHTS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                  "linear_fc2.weight", "output_layer.weight")


def sync():
    if GPU:
        torch.cuda.synchronize()


class Timed:
    """Wall time of a block with the device synchronised at both ends, in ms."""

    def __init__(self, times: list):
        self.times = times

    def __enter__(self):
        sync()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        sync()
        self.times.append((time.perf_counter() - self.start) * 1e3)


def setup():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    config = validate_args(parse_args(FLAGS + FP8), 1)
    model = build_model(config, ParallelState(RankGrid(1), 0), DEVICE,
                        build_rng_tracker(1234, 0, DEVICE))[0]
    params = [p for p in model.parameters() if p.requires_grad]
    buffer = GradBuffer(params, None, 10 ** 9, overlap=True, grad_dtype=torch.float32)
    buffer.linear_step = LinearStep()  # as train_step.StepRunner installs it
    buffer.linear_step.install(model)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g).to(DEVICE)
               for _ in range(2)]
    return config, model, buffer, batches


def forward(config, model, tokens):
    with autocast(config.precision, DEVICE):
        return model(tokens[:, :-1], tokens[:, 1:]).float().mean()


def ordinary(config, model, buffer, batches, times=None):
    """F F, then each micro-batch's ordinary backward: {name: main_grad}."""
    buffer.start_step(2)
    losses = [forward(config, model, tokens) for tokens in batches]
    for loss in losses:
        with Timed(times if times is not None else []):
            loss.backward()
    buffer.finish()
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}


def split(config, model, buffer, batches, b_times=None, w_times=None):
    """F F B B W W: ({name: main_grad}, names whose main_grad was still zero after both
    Bs, the weights the stores deferred)."""
    buffer.start_step(2)
    losses = [forward(config, model, tokens) for tokens in batches]
    stores = [WeightGradStore() for _ in batches]
    for loss, store in zip(losses, stores):
        with Timed(b_times if b_times is not None else []), \
                buffer.linear_step.defer_weight_grads(store):
            loss.backward()
    untouched = {n for n, p in model.named_parameters() if not p.main_grad.any()}
    deferred = len(stores[0].weights)
    for store in stores:
        with Timed(w_times if w_times is not None else []):
            store.run()
    buffer.finish()
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}, untouched, deferred


def differing(a: dict, b: dict) -> list[str]:
    return [f"{n} (max diff {(a[n] - b[n]).abs().max().item():.2e})" for n in a
            if not torch.equal(a[n], b[n])]


def main():
    check = Checks()
    torch.use_deterministic_algorithms(True)
    config, model, buffer, batches = setup()
    reference = ordinary(config, model, buffer, batches)
    again = differing(ordinary(config, model, buffer, batches), reference)
    if not check(f"ordinary backward on {DEVICE.type} twice", not again,
                 "bit-equal" if not again else f"NOT deterministic here: {again[:3]}"):
        check.exit()
    grads, untouched, deferred = split(config, model, buffer, batches)
    linears = {n for n in grads if n.endswith(LINEAR_WEIGHTS)}
    check("B passes leave every linear weight to W", untouched == linears
          and deferred == len(linears), f"{len(linears)} linear weights, {deferred} "
          f"deferred by a B pass, main_grad still zero after both Bs: {len(untouched)}")
    wrong = differing(grads, reference)
    check("F F B B W W vs F F and ordinary backwards", not wrong,
          f"every main_grad of {len(grads)} parameters bit-equal" if not wrong
          else f"{len(wrong)} differ: {wrong[:3]}")
    backward, b, w = [], [], []
    for _ in range(3 if GPU else 1):
        ordinary(config, model, buffer, batches, backward)
        split(config, model, buffer, batches, b, w)
    ms = {k: statistics.median(v) for k, v in (("backward", backward), ("B", b), ("W", w))}
    print(f">> per micro-batch{' (FP8 linears)' if FP8 else ''} ({LAYERS} layers, hidden "
          f"{HIDDEN}, {MICRO} x {SEQ} tokens, "
          f"{len(linears)} weights in W): ordinary backward {ms['backward']:.2f} ms; B "
          f"{ms['B']:.2f} ms + W {ms['W']:.2f} ms = {ms['B'] + ms['W']:.2f} ms "
          f"({(ms['B'] + ms['W']) / ms['backward']:.2f}x the ordinary backward)")
    dist.destroy_process_group()
    check.exit()


if __name__ == "__main__":
    main()
