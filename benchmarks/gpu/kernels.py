"""Attention and RNG on this device: SDPA against the unfused reference (bf16 and fp32,
GQA, forward and backward), which SDPA kernels (flash, efficient, cuDNN) take the
training shapes, the RNG tracker, and activation recompute reproducing dropout."""
import sys
import time

import torch
import torch.distributed as dist

from megalite.arguments import parse_args
from megalite.attention_backends import core_attention, flash_attn_available
from megalite.parallel_state import ParallelState, RankGrid
from megalite.tensor_parallel.random import MODEL_PARALLEL_RNG, build_rng_tracker
from megalite.train_step import autocast
from megalite.training import build_model
from megalite.validation import validate_args

gpu = torch.cuda.is_available()
dev = torch.device("cuda" if gpu else "cpu")
failed = []
# [batch, seq, heads, kv heads, head dim] of the models gpu_check.sh trains.
TRAINING_SHAPES = {"TinyLlama 1.1B": (2, 2048, 32, 4, 64), "GPT 1.3B": (2, 2048, 16, 16, 128),
                   "GPT-2 350M": (2, 1024, 16, 16, 64)}


def check(name, ok, detail):
    print(f">> {'ok  ' if ok else 'BAD '} {name}: {detail}", flush=True)
    if not ok:
        failed.append(name)


def qkv(b, s, h, kv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g).to(dev, dtype).requires_grad_()
            for n in (h, kv, kv)]


def fwd_bwd(backend, q, k, v, dropout=0.0):
    q.grad = k.grad = v.grad = None
    out = core_attention(q, k, v, backend=backend, dropout_p=dropout)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out))
    return [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]


def sdpa_matches_unfused():
    """Max error relative to each tensor's max (absolute below 1: with one key, dq and dk
    are exactly 0 in the reference and rounding noise in a kernel)."""
    seqs = (1, 7, 257, 1024) if gpu else (1, 7, 65)
    for dtype, tol in ((torch.bfloat16, 5e-2), (torch.float32, 1e-4)):
        worst = 0.0
        for kv in (8, 2, 1):
            for s in seqs:
                q, k, v = qkv(2, s, 8, kv, 64, dtype, s + kv)
                for x, y in zip(fwd_bwd("sdpa", q, k, v), fwd_bwd("unfused", q, k, v)):
                    worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp_min(1.0)).item())
        check(f"sdpa vs unfused on {dev.type}, {dtype}, GQA 8/8,8/2,8/1", worst < tol,
              f"max rel err {worst:.1e} (tol {tol:.0e})")


def time_fwd_bwd(backend, q, k, v, repeats=5) -> float:
    """Milliseconds per forward + backward (device work only: the output gradient is made
    once, on the device)."""
    grad = torch.randn(q.shape, device=dev, dtype=q.dtype)

    def run():
        q.grad = k.grad = v.grad = None
        core_attention(q, k, v, backend=backend).backward(grad)
    run()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats * 1e3


def fused_kernels_on_training_shapes():
    """Which SDPA kernels accept each model's attention (bf16, causal, its GQA and head
    dim), with and without dropout; and the time of what megalite runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kernels = (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
               ("cudnn", SDPBackend.CUDNN_ATTENTION))
    for model, (b, s, h, kv, d) in TRAINING_SHAPES.items():
        q, k, v = qkv(b, s, h, kv, d, torch.bfloat16, 0)
        taken = []
        for name, backend in kernels:
            for p in (0.0, 0.1):
                try:
                    with sdpa_kernel([backend]):
                        fwd_bwd("sdpa", q, k, v, p)
                    taken.append(f"{name}{'+dropout' if p else ''}")
                except Exception as e:  # noqa: BLE001 (a refusal names its reason)
                    print(f">>   {model}: {name} (dropout {p}) refused: "
                          f"{str(e).splitlines()[0][:100]}")
        times = {b: time_fwd_bwd(b, q, k, v) for b in ("sdpa", "unfused")
                 + (("flash",) if flash_attn_available() else ())}
        print(f">> {model} [{b}, {s}, {h}/{kv} heads, {d}] bf16: SDPA kernels that take it: "
              f"{', '.join(taken) or 'none'}; fwd+bwd ms: "
              + ", ".join(f"{k} {t:.2f}" for k, t in times.items()), flush=True)
        if not taken:
            failed.append(f"no fused SDPA kernel for {model}")


def rng_tracker():
    tracker, other = build_rng_tracker(1234, 0, dev), build_rng_tracker(1234, 1, dev)
    torch.manual_seed(7)
    plain = torch.rand(4096, device=dev)
    torch.manual_seed(7)
    with tracker.fork():
        a = torch.rand(4096, device=dev)
    after = torch.rand(4096, device=dev)
    with tracker.fork():
        a2 = torch.rand(4096, device=dev)
    with other.fork():
        b = torch.rand(4096, device=dev)
    state = tracker.get_states()[MODEL_PARALLEL_RNG]
    check("rng tracker", torch.equal(plain, after) and not torch.equal(a, plain)
          and not torch.equal(a, a2) and not torch.equal(a, b)
          and state.device.type == "cpu" and state.dtype == torch.uint8,
          "fork leaves the default stream alone, advances its own, differs per TP rank; "
          "state is a CPU uint8 tensor")


# Tiny on a CPU (SMOKE): this checks the script there, not the numerics.
LAYERS, HIDDEN, SEQ = (4, 256, 128) if gpu else (2, 64, 32)
BASE = ["--mock-data", "--vocab-size", "512", "--num-layers", str(LAYERS),
        "--hidden-size", str(HIDDEN),
        "--num-attention-heads", "8", "--seq-length", str(SEQ), "--micro-batch-size", "4",
        "--train-iters", "1", "--lr", "1e-3", "--attention-dropout", "0.1",
        "--hidden-dropout", "0.1", "--position-embedding-type", "rope"]


def one_process_state():
    """The ParallelState pretrain() builds for one process (the real one, not a stand-in
    that misses the groups added since). Its groups have one rank, so nothing is sent over
    them and gloo serves on any device."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return ParallelState(RankGrid(1), 0)


def grads(extra):
    config = validate_args(parse_args(BASE + extra), 1)
    model = build_model(config, one_process_state(), dev, build_rng_tracker(1234, 0, dev))[0]
    tokens = torch.randint(0, 512, (4, SEQ), generator=torch.Generator().manual_seed(3)).to(dev)
    torch.manual_seed(11)
    with autocast(config.precision, dev):
        loss = model(tokens, tokens).mean()
    loss.backward()
    return loss.item(), [p.grad.float() for p in model.parameters()]


def recompute_reproduces_dropout():
    for prec, tol in (([], 1e-4), (["--bf16"], 2e-2)):
        ref_loss, ref = grads(prec)
        for name, flags in (("selective", ["--recompute-granularity", "selective"]),
                            ("full", ["--recompute-granularity", "full", "--recompute-method",
                                      "uniform", "--recompute-num-layers", "1"])):
            loss, got = grads(prec + flags)
            err = max(((x - y).norm() / y.norm().clamp_min(1e-12)).item()
                      for x, y in zip(got, ref))
            check(f"{name} recompute {'bf16' if prec else 'fp32'} on {dev.type}",
                  abs(loss - ref_loss) <= 1e-6 * abs(ref_loss) and err < tol,
                  f"loss {loss:.6f} vs {ref_loss:.6f}, max rel grad diff {err:.1e} "
                  f"(tol {tol:.0e})")


if __name__ == "__main__":
    sdpa_matches_unfused()
    if gpu:
        fused_kernels_on_training_shapes()
    else:
        print(">> fused SDPA kernels: skipped (no GPU)")
    rng_tracker()
    recompute_reproduces_dropout()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)
