"""Per-rank memory of parameters, gradients and optimizer state, and data-parallel bytes
per step, for DP = 1, 2, 4 with and without ZeRO-1, next to the ZeRO paper's formulas.

Mixed-precision Adam as in Rajbhandari et al. 2020 (§3.1): Ψ parameters in bf16 (2Ψ
bytes), their gradients in bf16 (2Ψ), and K = 12 bytes per parameter of optimizer state
(fp32 main copy, Adam's two moments). Plain DP holds (2 + 2 + 12)Ψ on every rank;
ZeRO-1 (P_os) holds (2 + 2 + 12/N)Ψ. Bytes are counted from the tensors themselves
after a real training step (megalite.train_step.StepRunner).

Data-parallel traffic is counted at the collectives (every all-reduce, reduce-scatter and
all-gather of more than one element; the scalar loss, token-count and norm reductions
are left out) as ring wire bytes per rank: 2(N-1)/N x the tensor for an all-reduce,
(N-1)/N for a reduce-scatter or all-gather. Closed form for both: 2(N-1)/N x the gradient
bytes (ZeRO-1's reduce-scatter + all-gather move what one all-reduce moves).

    python benchmarks/zero_memory.py [--device cpu|cuda]

On GPUs (--device cuda, the default when one is visible) each rank drives its own GPU over
NCCL (NCCL refuses two ranks on one GPU): rows with more ranks than visible GPUs are
skipped with a note. On the CPU the ranks run over gloo.
"""

import argparse

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megalite.config import OptimizerConfig, PrecisionConfig  # noqa: E402
from megalite.distributed.grad_buffer import GradBuffer  # noqa: E402
from megalite.model.config import GPTConfig  # noqa: E402
from megalite.model.gpt import build_model_chunks  # noqa: E402
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer  # noqa: E402
from megalite.parallel_state import ParallelState, RankGrid  # noqa: E402
from megalite.train_step import StepRunner  # noqa: E402
from rank_setup import add_device_flag, describe, init_rank  # noqa: E402

CONFIG = GPTConfig(num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
                   num_query_groups=4, kv_channels=32, seq_length=64, max_position_embeddings=64,
                   padded_vocab_size=1024, attention_dropout=0.0, hidden_dropout=0.0,
                   attention_backend="sdpa")
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_gather": lambda n: (n - 1) / n}


def count_collectives(counter: dict, world: int):
    """Wrap torch.distributed's collectives to add their ring wire bytes to counter."""
    names = {"all_reduce": 0, "reduce_scatter_tensor": 1, "reduce_scatter_single": 1,
             "all_gather_into_tensor": 0, "all_gather_single": 0}
    for name, full_arg in names.items():
        original = getattr(dist, name, None)
        if original is None:
            continue
        kind = next(k for k in WIRE if name.startswith(k))

        def wrapped(*args, _original=original, _kind=kind, _full=full_arg, **kwargs):
            tensor = args[_full]
            if tensor.numel() > 1:
                counter["bytes"] += WIRE[_kind](world) * tensor.numel() * tensor.element_size()
            return _original(*args, **kwargs)
        setattr(dist, name, wrapped)


def worker(rank, world, zero, store, out, device_type):
    device = init_rank(rank, world, store, device_type)
    state = ParallelState(RankGrid(world), rank)
    chunks = build_model_chunks(CONFIG, 1).to(device=device, dtype=torch.bfloat16)
    grad_buffer = GradBuffer(list(chunks.parameters()), state.dp_group, 10 ** 9, shard=zero)
    optimizer = MixedPrecisionOptimizer(chunks, OptimizerConfig(lr=1e-3), None, None, None,
                                        grad_buffer)
    precision = PrecisionConfig(bf16=True)
    runner = StepRunner(chunks, optimizer, precision, 1, (64, 2, 128), device, state,
                        grad_buffer)
    counter = {"bytes": 0.0}
    count_collectives(counter, world)
    batch = {"tokens": torch.randint(0, 1024, (2, 64), device=device),
             "labels": torch.randint(0, 1024, (2, 64), device=device),
             "loss_mask": torch.ones(2, 64, device=device)}
    runner.train_step([batch])
    params = list(chunks.parameters())
    row = [sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params),
           sum(b.flat.numel() * b.flat.element_size() for b in grad_buffer.buckets),
           optimizer.optimizer_state_bytes(), counter["bytes"]]
    torch.save(row, f"{out}.{rank}")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_flag(p)
    device = p.parse_args().device
    print(f"bf16 parameters and gradients, fp32 Adam state; MiB per rank (rank 0); on "
          f"{describe(device)}")
    print(f"{'DP':>2} {'ZeRO-1':>6} {'params':>7} {'grads':>7} {'optim':>7} {'total':>7} "
          f"{'paper':>7} | {'DP MiB/step':>11} {'2(N-1)/N x grads':>16} {'ratio':>5}")
    mib = 2.0 ** 20
    for dp in (1, 2, 4):
        if device == "cuda" and dp > torch.cuda.device_count():
            print(f"{dp:>2} skipped: needs {dp} GPUs (one rank per GPU under NCCL)")
            continue
        for zero in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "row")
                mp.spawn(worker, args=(dp, zero, os.path.join(tmp, "store"), out, device),
                         nprocs=dp)
                psi, params, grads, optim, traffic = torch.load(f"{out}.0")
            paper = (2 + 2 + 12 / (dp if zero else 1)) * psi
            closed = 2 * (dp - 1) / dp * grads
            ratio = f"{traffic / closed:5.3f}" if closed else "  -  "
            print(f"{dp:>2} {'yes' if zero else 'no':>6} {params / mib:7.3f} {grads / mib:7.3f} "
                  f"{optim / mib:7.3f} {(params + grads + optim) / mib:7.3f} {paper / mib:7.3f} | "
                  f"{traffic / mib:11.3f} {closed / mib:16.3f} {ratio}")
    print(f"Ψ = {psi:,} parameters")


if __name__ == "__main__":
    main()
