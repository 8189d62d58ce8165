"""Attention across the context-parallel group against full causal attention in one process.

One launch per CP size runs every case (comm type x backend x MHA/GQA): each rank cuts its
two load-balanced chunks out of the same seeded full q, k, v, runs context_parallel_attention
forward and backward, and returns its rows; the parent puts the rows back in sequence order
and compares output and the q/k/v gradients with torch's scaled_dot_product_attention over the
whole sequence (fp32). The same launch counts the bytes passed to the collectives against
cp_comm_bytes, and checks both kinds' backward with dropout by a directional derivative (fp64).
The block merge is checked in one process against the same reference, with each block kernel
(blocks.py, the unfused reference, and fused_blocks.py, torch's flash kernels), and the fused
blocks against blocks.py block by block.
"""

import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.context_parallel import context_parallel_attention, cp_backend_check, cp_comm_bytes
from megalite.context_parallel import blocks, fused_blocks
from megalite.context_parallel.blocks import block_backward, block_forward, merge
from megalite.context_parallel.ring import block_kernels, ring_blocks
from megalite.context_split import load_balanced_chunks
from megalite.errors import ConfigError
from megalite.spawn import run_distributed

B, S, D = 2, 16, 8                                # batch, whole sequence, head dim
HEADS = {"mha": (4, 4), "gqa": (4, 2)}            # (query heads, key/value heads)
CASES = [("all_gather", "sdpa", "gqa"), ("all_gather", "unfused", "mha"),
         ("p2p", "unfused", "mha"), ("p2p", "unfused", "gqa"), ("p2p", "sdpa", "mha"),
         ("p2p", "sdpa", "gqa")]


def full_inputs(kind: str, seed: int = 0, dtype=torch.float32):
    heads, kv_heads = HEADS[kind]
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, S, heads, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, S, kv_heads, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, dout


def reference(q, k, v, dout):
    """torch's causal SDPA over the whole sequence: output and (dq, dk, dv)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         is_causal=True, enable_gqa=True).transpose(1, 2)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def local_rows(cp: int, rank: int) -> torch.Tensor:
    """Sequence positions of this CP rank's rows, in local order."""
    c = S // (2 * cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c) for j in load_balanced_chunks(cp, rank)])


# ---------------------------------------------------------------- distributed

def _count_received(counts: list):
    """Wrap the collectives and batch_isend_irecv: record the bytes this rank receives
    from the others (all-gather: output minus own input; reduce-scatter: input minus own
    output; point-to-point: the irecv buffers)."""
    def wrap(name, received):
        original = getattr(dist, name)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            counts.append(received(*args))
            return original(*args, **kwargs)
        setattr(dist, name, counted)

    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            wrap(name, lambda out, x, *a: nbytes(out) - nbytes(x))
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            wrap(name, lambda out, x, *a: nbytes(x) - nbytes(out))
    wrap("batch_isend_irecv",
         lambda ops: sum(nbytes(op.tensor) for op in ops if op.op is dist.irecv))


def _run_case(cp, rank, comm_type, backend, kind, counts):
    q, k, v, dout = full_inputs(kind)
    idx = local_rows(cp, rank)
    q, k, v = (t[:, idx].clone().requires_grad_() for t in (q, k, v))
    counts.clear()
    out = context_parallel_attention(q, k, v, cp_group=dist.group.WORLD, comm_type=comm_type,
                                     backend=backend)
    forward_bytes = sum(counts)
    out.backward(dout[:, idx])
    return out.detach(), q.grad, k.grad, v.grad, (forward_bytes, sum(counts) - forward_bytes)


def _dropout_directional(cp, rank, comm_type):
    """(<d out, dout>/dε by central difference, the same from the gradients, <out, dout>
    twice, <out, dout> without dropout), fp64, dropout 0.3, the same masks in every call
    (each rank's generator reset to its own seed, as the RNG tracker gives each CP rank its
    own stream)."""
    q, k, v, dout = full_inputs("gqa", seed=1, dtype=torch.float64)
    dq, dk, dv, _ = full_inputs("gqa", seed=2, dtype=torch.float64)  # a direction
    idx = local_rows(cp, rank)
    q, k, v, dout, dq, dk, dv = (t[:, idx] for t in (q, k, v, dout, dq, dk, dv))

    def f(eps, grad=False, dropout_p=0.3):
        torch.manual_seed(100 + rank)
        inputs = [(x + eps * d).requires_grad_(grad) for x, d in ((q, dq), (k, dk), (v, dv))]
        out = context_parallel_attention(*inputs, cp_group=dist.group.WORLD, comm_type=comm_type,
                                         backend="unfused", dropout_p=dropout_p)
        if grad:
            out.backward(dout)
            local = sum((x.grad * d).sum() for x, d in zip(inputs, (dq, dk, dv)))
        else:
            local = (out * dout).sum()
        local = local.detach().clone()
        dist.all_reduce(local)
        return local.item()

    eps = 1e-5
    return ((f(eps) - f(-eps)) / (2 * eps), f(0.0, grad=True), f(0.0), f(0.0),
            f(0.0, dropout_p=0.0))


def _ring_bf16_grads(cp, rank):
    """dK and dV of this rank's rows from the ring on bf16 q, k, v (blocks.py's fp32 block
    gradients, so that only the ring's accumulation rounds)."""
    q, k, v, dout = full_inputs("gqa", seed=3, dtype=torch.bfloat16)
    idx = local_rows(cp, rank)
    q, k, v = (t[:, idx].clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q, k, v, cp_group=dist.group.WORLD, comm_type="p2p",
                                     backend="unfused")
    out.backward(dout[:, idx])
    return k.grad, v.grad


def _cp_rank(rank, cp):  # cp = the world size
    counts = []
    _count_received(counts)
    results = {case: _run_case(cp, rank, *case, counts) for case in CASES}
    return (results, {c: _dropout_directional(cp, rank, c) for c in ("p2p", "all_gather")},
            _ring_bf16_grads(cp, rank))


def bf16_ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected| in units of bf16's spacing at `expected` (8 significant bits):
    a correctly rounded result is within 0.5."""
    _, exponent = torch.frexp(expected)
    return (actual.double() - expected).abs() / torch.ldexp(torch.ones_like(expected),
                                                             exponent - 8)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_matches_full_attention(cp):
    per_rank = run_distributed(cp, _cp_rank)
    for case in CASES:
        comm_type, backend, kind = case
        q, k, v, dout = full_inputs(kind)
        expected = reference(q, k, v, dout)
        for i, name in enumerate(("output", "dq", "dk", "dv")):
            actual = torch.empty_like(expected[i])
            for rank, (results, _, _) in enumerate(per_rank):
                actual[:, local_rows(cp, rank)] = results[case][i]
            torch.testing.assert_close(actual, expected[i], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"CP {cp} {case} {name}: {m}")
        closed = cp_comm_bytes(comm_type, cp_size=cp, batch=B, seq_length=S,
                               kv_heads=HEADS[kind][1], head_dim=D, element_size=4)
        for rank, (results, _, _) in enumerate(per_rank):
            assert results[case][4] == (closed.forward, closed.backward), (cp, case, rank)
    for comm_type, (numeric, analytic, once, again, no_dropout) in per_rank[0][1].items():
        assert once == again, comm_type  # the masks depend only on the generator state
        assert abs(once - no_dropout) > 1e-3 * abs(no_dropout), comm_type  # dropout acted
        assert abs(numeric - analytic) < 1e-6 * max(1.0, abs(analytic)), (comm_type, numeric,
                                                                          analytic)
    # bf16: the ring's dV is the fp32 sum over the CP ranks' blocks rounded once (within
    # half a bf16 step of the exact sum); a bf16 accumulator rounds at every hop. (dK also
    # carries the bf16 output through D = rowsum(dO * O), whatever the accumulator.)
    q, k, v, dout = (t.double() for t in full_inputs("gqa", seed=3, dtype=torch.bfloat16))
    dv_ref = reference(q, k, v, dout)[3]
    dv = torch.empty_like(dv_ref)
    for rank, (_, _, (dk_rank, dv_rank)) in enumerate(per_rank):
        assert dk_rank.dtype == dv_rank.dtype == torch.bfloat16
        dv[:, local_rows(cp, rank)] = dv_rank.double()
    assert bf16_ulps(dv, dv_ref).max() <= 0.5 + 1e-3, (cp, bf16_ulps(dv, dv_ref).max())


# ---------------------------------------------------------------- one process

@pytest.mark.parametrize("kernels", [blocks, fused_blocks], ids=["blocks", "fused_blocks"])
@pytest.mark.parametrize("kind", ["mha", "gqa"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_blocks_merge_to_full_attention(cp, kind, kernels):
    """Every rank's ring blocks, computed and merged here, give full attention forward and
    backward; the blocks cover each visible chunk pair exactly once (fully masked pairs
    skipped, diagonal pairs under a causal mask, the rest unmasked), the same work per rank."""
    q, k, v, dout = full_inputs(kind)
    out_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, dout)
    c, scale = S // (2 * cp), D ** -0.5
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        idx = local_rows(cp, rank)
        chunks, plan = load_balanced_chunks(cp, rank), []
        visible, work = Counter(), 0
        out = torch.zeros(B, 2 * c, q.shape[2], D)
        lse = torch.full((B, q.shape[2], 2 * c), float("-inf"))  # no keys yet
        for src in range(cp):
            kidx = local_rows(cp, src)
            for rows, keys, causal in ring_blocks(cp, rank, src, c):
                o, l_, state = kernels.block_forward(q[:, idx[rows]], k[:, kidx[keys]],
                                                     v[:, kidx[keys]], causal=causal, scale=scale)
                plan.append((rows, keys, causal, kidx, state))
                out[:, rows], lse[:, :, rows] = merge(out[:, rows], lse[:, :, rows], o, l_)
                pairs = [(chunks[a], load_balanced_chunks(cp, src)[j])  # (query, key) chunks
                         for a in range(rows.start // c, rows.stop // c)
                         for j in range(keys.start // c, keys.stop // c)]
                work += len(pairs)
                # No fully masked pair; a causal mask exactly where a diagonal pair is.
                assert all(kc <= qc for qc, kc in pairs), (rank, src, pairs)
                assert causal == any(kc == qc for qc, kc in pairs), (rank, src, pairs)
                visible.update(pairs)
        # Every visible chunk pair exactly once; the same work on every rank.
        assert visible == Counter((qc, kc) for qc in chunks for kc in range(qc + 1)), rank
        assert work == 2 * cp + 1, (rank, work)
        torch.testing.assert_close(out, out_ref[:, idx], rtol=1e-5, atol=1e-5)
        dq = torch.zeros(B, 2 * c, q.shape[2], D)
        for rows, keys, causal, kidx, state in plan:
            dq_b, dk_b, dv_b = kernels.block_backward(
                dout[:, idx[rows]], q[:, idx[rows]], k[:, kidx[keys]], v[:, kidx[keys]],
                out[:, rows], lse[:, :, rows], causal=causal, scale=scale, rng_state=state)
            dq[:, rows] += dq_b
            dk[:, kidx[keys]] += dk_b
            dv[:, kidx[keys]] += dv_b
        torch.testing.assert_close(dq, dq_ref[:, idx], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dk, dk_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dv, dv_ref, rtol=1e-5, atol=1e-5)


CUDA_FLASH = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
NEEDS_CUDA_FLASH = pytest.mark.skipif(
    not CUDA_FLASH, reason="needs a CUDA GPU (sm80+) for torch's CUDA flash kernel")
# (device, dtype, atol of out, of lse, of the gradients): fp32 on the CPU kernel to round-
# off; half precision on the CUDA kernel (the ring's under --bf16/--fp16 on a GPU) to the
# rounding of the kernel's half-precision block output.
KERNELS = [pytest.param("cpu", torch.float32, 1e-5, 1e-5, 1e-5, id="cpu-fp32"),
           pytest.param("cuda", torch.bfloat16, 1e-2, 1e-4, 2e-2, id="cuda-bf16",
                        marks=NEEDS_CUDA_FLASH),
           pytest.param("cuda", torch.float16, 1e-2, 1e-4, 2e-2, id="cuda-fp16",
                        marks=NEEDS_CUDA_FLASH)]


@pytest.mark.parametrize("device, dtype, out_atol, lse_atol, grad_atol", KERNELS)
@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_fused_blocks_equal_the_unfused_blocks(kind, device, dtype, out_atol, lse_atol,
                                               grad_atol):
    """Each kind of ring block (causal c x c, causal c x 2c aligned to the lower right,
    unmasked c x 2c and 2c x c) on torch's flash kernels gives blocks.py's out and lse on
    the same inputs, and, given a row's MERGED out and lse (here merged with another block
    of keys, so that they differ from the block's own), blocks.py's dq, dk, dv."""
    device = torch.device(device)
    assert fused_blocks.unavailable_reason(device, dtype, D) is None
    q, k, v, dout = (t.to(device, dtype) for t in full_inputs(kind))
    c, scale = S // 4, D ** -0.5
    _, other_k, other_v, _ = (t.to(device, dtype) for t in full_inputs(kind, seed=1))
    for rows, keys, causal in ((slice(0, c), slice(0, c), True),
                               (slice(c, 2 * c), slice(0, 2 * c), True),
                               (slice(c, 2 * c), slice(0, 2 * c), False),
                               (slice(0, 2 * c), slice(0, c), False)):
        qb, kb, vb = q[:, rows], k[:, keys], v[:, keys]
        ref_out, ref_lse, _ = block_forward(qb, kb, vb, causal=causal, scale=scale)
        out, lse, state = fused_blocks.block_forward(qb, kb, vb, causal=causal, scale=scale)
        case = f"{kind} rows {rows} keys {keys} causal={causal}"
        for name, mine, ref, atol in (("out", out, ref_out, out_atol),
                                      ("lse", lse, ref_lse, lse_atol)):
            assert mine.shape == ref.shape, (case, name, mine.shape, ref.shape)
            torch.testing.assert_close(mine, ref, rtol=0, atol=atol,
                                       msg=lambda m: f"{case} {name}: {m}")
        # The rows' other keys: c keys of another draw, unmasked.
        o2, l2, _ = block_forward(qb, other_k[:, 3 * c:], other_v[:, 3 * c:], causal=False,
                                  scale=scale)
        merged_out, merged_lse = merge(ref_out, ref_lse, o2, l2)
        assert (merged_lse - ref_lse).abs().min() > 1e-3  # the merge moved every row's lse
        ref_grads = block_backward(dout[:, rows], qb, kb, vb, merged_out, merged_lse,
                                   causal=causal, scale=scale)
        grads = fused_blocks.block_backward(dout[:, rows], qb, kb, vb, merged_out, merged_lse,
                                            causal=causal, scale=scale, rng_state=state)
        for name, mine, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert mine.shape == ref.shape and mine.dtype == ref.dtype, (case, name)
            # rtol as atol: half-precision gradients are off by a fraction of their size.
            torch.testing.assert_close(mine, ref, rtol=0 if dtype == torch.float32 else
                                       grad_atol, atol=grad_atol,
                                       msg=lambda m: f"{case} {name}: {m}")


def test_block_backward_with_dropout_matches_autograd():
    """block_backward redraws the forward's dropout mask: its gradients equal autograd's
    through block_forward and merge of two key blocks."""
    q, k, v, dout = full_inputs("gqa", dtype=torch.float64)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    kw = dict(scale=D ** -0.5, dropout_p=0.25)
    torch.manual_seed(7)
    o1, l1, st1 = block_forward(q, k[:, :S // 2], v[:, :S // 2], causal=False, **kw)
    o2, l2, st2 = block_forward(q, k, v, causal=True, **kw)  # keys again: two draws differ
    out, lse = merge(o1, l1, o2, l2)
    out.backward(dout)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for keys, causal, state in ((slice(0, S // 2), False, st1), (slice(0, S), True, st2)):
        dq_b, dk_b, dv_b = block_backward(dout, q.detach(), k.detach()[:, keys],
                                          v.detach()[:, keys], out.detach(), lse.detach(),
                                          causal=causal, rng_state=state, **kw)
        grads[0] += dq_b
        grads[1][:, keys] += dk_b
        grads[2][:, keys] += dv_b
    for name, mine, auto in zip("qkv", grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, auto, msg=lambda m: f"d{name}: {m}")


def test_load_balanced_chunks():
    assert [load_balanced_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    with pytest.raises(ValueError):
        load_balanced_chunks(2, 2)


def test_cp_backend_check():
    for backend in ("auto", "flash", "sdpa", "unfused"):
        for comm_type in ("all_gather", "p2p"):
            cp_backend_check(backend, comm_type, 0.1)
    with pytest.raises(ConfigError, match="--cp-comm-type a2a"):
        cp_backend_check("unfused", "a2a", 0.0)
    with pytest.raises(ConfigError, match="--attention-backend fused"):
        cp_backend_check("fused", "p2p", 0.0)


@pytest.mark.parametrize("capability, head_dim, runs", [
    ((8, 0), 256, True), ((9, 0), 224, True), ((8, 0), 224, True),
    ((8, 6), 192, True), ((8, 6), 200, False), ((8, 9), 224, False), ((8, 9), 256, True),
    ((12, 0), 224, False), ((7, 5), 64, False), ((9, 0), 264, False), ((9, 0), 100, False)])
def test_cuda_flash_kernel_refuses_what_its_backward_cannot_run(capability, head_dim, runs):
    """torch's CUDA flash backward (torch 2.13, sdp_utils.cpp) needs sm80+, a head size in
    steps of 8 up to 256, and on sm86-sm89 and sm120-121 (A10, L4, L40S, RTX) not 200-224;
    a refused block runs blocks.py under sdpa, a ConfigError under flash (block_kernels)."""
    reason = fused_blocks.cuda_unavailable_reason(capability, torch.bfloat16, head_dim)
    assert (reason is None) == runs, reason
    assert fused_blocks.cuda_unavailable_reason((9, 0), torch.float32, 64) is not None


def test_ring_block_kernels_follow_the_attention_backend():
    """unfused and attention dropout run blocks.py; sdpa and flash torch's fused kernels
    where they run (the CPU), else sdpa falls back to blocks.py and flash refuses by name."""
    q = torch.zeros(1, 4, 2, 8)
    assert block_kernels("unfused", q, 0.0) is blocks
    assert block_kernels("sdpa", q, 0.0) is block_kernels("flash", q, 0.0) is fused_blocks
    assert block_kernels("sdpa", q, 0.1) is block_kernels("flash", q, 0.1) is blocks
    elsewhere = q.to("meta")  # a device without a fused kernel
    assert block_kernels("sdpa", elsewhere, 0.0) is blocks
    with pytest.raises(ConfigError, match="--attention-backend flash.*meta.*sdpa or unfused"):
        block_kernels("flash", elsewhere, 0.0)


def test_cp_size_one_is_core_attention():
    q, k, v, _ = full_inputs("gqa")
    out = context_parallel_attention(q, k, v, cp_group=None, comm_type="p2p", backend="sdpa")
    torch.testing.assert_close(out, reference(q, k, v, torch.zeros_like(q))[0])
