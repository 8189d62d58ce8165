"""Ring attention's kernels on this device against whole-sequence attention.

- CP 2 and 4 emulated in one process: every rank's ring blocks (ring.ring_blocks) on the
  fused kernels (fused_blocks.py: torch's CUDA flash kernel in bf16 on a GPU; its CPU kernel
  in fp32 under SMOKE), merged by their log-sum-exp (blocks.merge) in fp32, the output
  rounded to the input dtype as ring.py rounds it; the backward of each block from the
  merged out and lse, dK/dV summed over the ranks in fp32;
- the ring's autograd function (ring.ring_attention) over a one-rank group (NCCL on a GPU):
  its two causal blocks, its exchange (a send to itself) and its accumulators.
Reference: causal SDPA over the whole sequence in fp32 (the math kernel) on the same
inputs. Tolerance: an error (max |x - ref| / max |ref| per tensor) at most twice that of
the device's own whole-sequence SDPA in the input dtype, or the dtype's rounding step.
"""

import contextlib
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.gpu.ring_emulation import emulated_ring
from benchmarks.gpu.runs import GPU, Checks
from megalite.context_parallel import fused_blocks
from megalite.context_parallel.ring import block_kernels, ring_attention

DEVICE = torch.device("cuda", 0) if GPU else torch.device("cpu")
DTYPE = torch.bfloat16 if GPU else torch.float32
FLOOR = 2 ** -8 if GPU else 1e-5  # bf16's rounding step; fp32 round-off of the CPU kernel
# [batch, seq, heads, kv heads, head dim]: TinyLlama's GQA and GPT 1.3B's MHA on a GPU.
SHAPES = ({"GQA 32/4, d 64": (2, 2048, 32, 4, 64), "MHA 16, d 128": (2, 2048, 16, 16, 128)}
          if GPU else {"GQA 4/2, d 16": (2, 64, 4, 2, 16), "MHA 4, d 32": (2, 64, 4, 4, 32)})
NAMES = ("out", "dq", "dk", "dv")


def inputs(b, s, h, kv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, s, h, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, s, kv, d, generator=g) for _ in range(2))
    return [t.to(DEVICE, DTYPE) for t in (q, k, v, dout)]


def sdpa(q, k, v, dout, math: bool):
    """Whole-sequence causal SDPA: (out, dq, dk, dv); fp32 math kernel when `math`."""
    q, k, v = (t.float() if math else t for t in (q, k, v))
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]) if math else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                             is_causal=True, enable_gqa=True).transpose(1, 2)
    out.backward(dout.to(out.dtype))
    return [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]


def one_rank_ring(q, k, v, dout):
    """ring_attention over the one-rank default group: forward and, where the backend can
    send to its own rank (NCCL; gloo cannot), backward, whose dK/dV accumulator is sent on
    even at CP 1."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, dist.group.WORLD, q.shape[-1] ** -0.5, 0.0, "sdpa")
    if dist.get_backend() == "gloo":
        print(">> (one-rank gloo group: forward only; gloo has no send to its own rank)")
        return [out.detach().float()]
    out.backward(dout)
    return [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]


def errors(got, ref):
    return [((x - y).abs().max() / y.abs().max()).item() for x, y in zip(got, ref)]


def compare(check, name, got, ref, kernel_err):
    err = errors(got, ref)
    tol = [max(2 * e, FLOOR) for e in kernel_err]
    check(name, all(e <= t for e, t in zip(err, tol)),
          ", ".join(f"{n} {e:.1e} (SDPA {k:.1e})" for n, e, k in zip(NAMES, err, kernel_err)))


def main():
    check = Checks()
    dist.init_process_group("nccl" if GPU else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, device_id=DEVICE if GPU else None)
    print(f">> {DEVICE.type}, {DTYPE}; error = max |x - fp32 SDPA| / max |fp32 SDPA|, "
          f"beside the device's whole-sequence SDPA in {DTYPE} (tolerance twice that)")
    for kind, (b, s, h, kv, d) in SHAPES.items():
        q, k, v, dout = inputs(b, s, h, kv, d)
        if not check(f"{kind}: fused kernels", block_kernels("sdpa", q, 0.0) is fused_blocks,
                     fused_blocks.unavailable_reason(DEVICE, DTYPE, d) or "taken"):
            continue
        ref, kernel = sdpa(q, k, v, dout, math=True), sdpa(q, k, v, dout, math=False)
        kernel_err = errors(kernel, ref)
        for cp in (2, 4):
            compare(check, f"{kind}: CP {cp} emulated", emulated_ring(cp, q, k, v, dout), ref,
                    kernel_err)
        compare(check, f"{kind}: ring_attention, one-rank {dist.get_backend()} group",
                one_rank_ring(q, k, v, dout), ref, kernel_err)
    dist.destroy_process_group()
    check.exit()


if __name__ == "__main__":
    main()
