"""Per-rank memory of parameters, gradients and optimizer state, and data-parallel bytes
per step, for DP = 1, 2, 4 with plain DP, ZeRO-1, ZeRO-2, ZeRO-3 (FSDP2) and ZeRO-3 with
optimizer CPU offload, next to the ZeRO paper's formulas and megalite's memory planner.

Mixed-precision Adam as in Rajbhandari et al. 2020 (§3.1, §5): Ψ parameters in bf16 (2Ψ
bytes), their gradients in bf16 (2Ψ), and K = 12 bytes per parameter of optimizer state
(fp32 main copy, Adam's two moments). Per rank: plain DP (2 + 2 + 12)Ψ; ZeRO-1 (P_os)
(2 + 2 + 12/N)Ψ; ZeRO-2 (P_os+g) (2 + (2 + 12)/N)Ψ; ZeRO-3 (P_os+g+p) (2 + 2 + 12)Ψ/N.
Bytes are counted from the tensors themselves after a real training step
(megalite.train_step.StepRunner). Under FSDP2 the fp32 parameter shards are the main copy
(params column, 4 B), the gradient shards fp32 (4 B), the optimizer column Adam's moments
(8 B): 16Ψ/N, the paper's ZeRO-3 total. "gathered" is the most bf16 compute parameters
alive at once during the step (transient; the planner's count beside it), "host"
what --optimizer-cpu-offload keeps in host memory (on the CPU, the same memory). The
largest FSDP2 reduction (a unit's bf16 gradients and the reduce-scatter input they are
copied into, both alive during the copy) is checked against the planner's, not printed.

Data-parallel traffic is counted at the collectives (every all-reduce, reduce-scatter and
all-gather of more than one element; the scalar loss, token-count and norm reductions
are left out) as ring wire bytes per rank: 2(N-1)/N x the tensor for an all-reduce,
(N-1)/N for a reduce-scatter or all-gather (benchmarks/common/wire_bytes.py). Closed form:
2(N-1)/N x the bf16 gradient bytes for plain DP, ZeRO-1 and ZeRO-2, 3(N-1)/N for ZeRO-3
(1.5x: the parameters are all-gathered again for the backward).

    python benchmarks/zero_memory.py [--device cpu|cuda]

Each row's closed-form claims are checked: a mismatch stops the run non-zero. SMOKE=1 (as
tests/test_doc_commands.py runs it) forks the CPU ranks instead of spawning them.

On GPUs (--device cuda, the default when one is visible) each rank drives its own GPU over
NCCL (NCCL refuses two ranks on one GPU): rows with more ranks than visible GPUs are
skipped with a note. On the CPU the ranks run over gloo.
"""

import argparse
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from benchmarks.common.rank_setup import add_device_flag, describe, launch, rank_device
from benchmarks.common.wire_bytes import count_wire_bytes
from megalite.arguments import parse_args
from megalite.config import (CheckpointConfig, Config, DistributedConfig, GPTConfig,
                             LoggingConfig, OptimizerConfig, ParallelConfig, PrecisionConfig,
                             TrainingConfig)
from megalite.distributed.fsdp import ZERO2, ZERO3, apply_fsdp
from megalite.distributed.grad_buffer import GradBuffer
from megalite.memory_estimate import weights_and_optimizer
from megalite.model.gpt import build_model_chunks
from megalite.optimizer.fsdp_optimizer import FullyShardedOptimizer
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.train_step import StepRunner
from megalite.validation import validate_model_args

CONFIG = GPTConfig(num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
                   num_query_groups=4, kv_channels=32, seq_length=64, max_position_embeddings=64,
                   padded_vocab_size=1024, attention_dropout=0.0, hidden_dropout=0.0,
                   attention_backend="sdpa")
MODES = ["plain", "zero1", "zero2", "zero3", "zero3+offload"]
PLANNER_FLAGS = ["--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "512",
                 "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "1024",
                 "--make-vocab-size-divisible-by", "1", "--micro-batch-size", "2",
                 # fp16, not bf16: the same 2-byte parameters, and no forced fp32 gradient
                 # buffer (--bf16 implies one), like this benchmark's bf16 buffer.
                 "--fp16", "--attention-backend", "sdpa"]
MODE_FLAGS = {"plain": [], "zero1": ["--use-distributed-optimizer"],
              "zero2": ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads"],
              "zero3": ["--use-torch-fsdp2"],
              "zero3+offload": ["--use-torch-fsdp2", "--optimizer-cpu-offload"]}


def build(mode: str, state, device):
    """(chunks, optimizer, grad buffer) of `mode`: bf16 parameters and gradients."""
    chunks = build_model_chunks(CONFIG, 1).to(device=device, dtype=torch.bfloat16)
    if mode.startswith("zero") and mode != "zero1":
        apply_fsdp(chunks.float(), state.dp_group, device,
                   strategy=ZERO2 if mode == "zero2" else ZERO3, param_dtype=torch.bfloat16,
                   reduce_dtype=torch.bfloat16, cpu_offload=mode.endswith("offload"))
        optimizer = FullyShardedOptimizer(chunks, OptimizerConfig(lr=1e-3), None, None, None)
        return chunks, optimizer, None
    grad_buffer = GradBuffer(list(chunks.parameters()), state.dp_group, 10 ** 9,
                             shard=mode == "zero1")
    optimizer = MixedPrecisionOptimizer(chunks, OptimizerConfig(lr=1e-3), None, None, None,
                                        grad_buffer)
    return chunks, optimizer, grad_buffer


def track_gathered(chunks, peak: dict):
    """Record the most bytes of gathered FSDP2 compute parameters alive at once: at each
    all-gather, the units already gathered (or gathered and not yet copied out, as a
    prefetched one is) plus the one being gathered. Reads FSDP2's per-unit state
    (private attributes of torch 2.13: this is a measurement, not a dependency)."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in chunks.modules()
              if isinstance(m, FSDPModule)]
    groups = [g for g in groups if g is not None]
    original = dist.all_gather_single

    def gathering(output_tensor, *args, **kwargs):
        alive = sum(sum(fp.sharded_param.numel() for fp in g.fsdp_params) * 2
                    for g in groups if g.is_unsharded or g._all_gather_result is not None)
        peak["bytes"] = max(peak["bytes"],
                            alive + output_tensor.numel() * output_tensor.element_size())
        return original(output_tensor, *args, **kwargs)
    dist.all_gather_single = gathering


def track_reduction(peak: dict):
    """Record the most bytes of one FSDP2 reduction: the unit's unsharded gradients and the
    reduce-scatter input they are copied into, both alive during the copy (FSDP2 frees the
    gradients after it). Wraps FSDP2's copy-in function (private, torch 2.13: a
    measurement, not a dependency)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    original = _fsdp_collectives.foreach_reduce_scatter_copy_in

    def copy_in(unsharded_grads, reduce_scatter_input, *args, **kwargs):
        alive = sum(g.numel() * g.element_size() for g in unsharded_grads) + \
            reduce_scatter_input.numel() * reduce_scatter_input.element_size()
        peak["bytes"] = max(peak["bytes"], alive)
        return original(unsharded_grads, reduce_scatter_input, *args, **kwargs)
    _fsdp_collectives.foreach_reduce_scatter_copy_in = copy_in


def worker(rank, world, mode, device_type):
    device = rank_device(rank, device_type)
    state = ParallelState(RankGrid(world), rank)
    chunks, optimizer, grad_buffer = build(mode, state, device)
    run = Config(model=CONFIG, parallel=ParallelConfig(), precision=PrecisionConfig(bf16=True),
                 training=TrainingConfig(micro_batch_size=2, global_batch_size=2 * world,
                                         num_microbatches=1),
                 logging=LoggingConfig(), distributed=DistributedConfig(),
                 checkpoint=CheckpointConfig(check_for_nan=False))
    runner = StepRunner(chunks, optimizer, run, state, device, grad_buffer)
    counter, peak, reduction = {}, {"bytes": 0}, {"bytes": 0}
    fsdp = grad_buffer is None
    if fsdp:
        track_gathered(chunks, peak)
        track_reduction(reduction)
    count_wire_bytes(counter)
    batch = {"tokens": torch.randint(0, 1024, (2, 64), device=device),
             "labels": torch.randint(0, 1024, (2, 64), device=device),
             "loss_mask": torch.ones(2, 64, device=device)}
    runner.train_step([batch])
    params = list(chunks.parameters())
    if fsdp:  # the fp32 shards (the main copy), their fp32 gradient shards, the moments
        local = [p.to_local() for p in params]
        param_bytes = sum(t.numel() * t.element_size() for t in local)
        grad_bytes = sum(p.grad.to_local().numel() * 4 for p in params)
        optim_bytes = optimizer.optimizer_state_bytes() - param_bytes
        psi = sum(p.numel() for p in params)
    else:
        psi = sum(p.numel() for p in params)
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        grad_bytes = sum(b.flat.numel() * b.flat.element_size() for b in grad_buffer.buckets)
        optim_bytes = optimizer.optimizer_state_bytes()
    on_host = mode.endswith("offload")
    return [psi, param_bytes, grad_bytes, optim_bytes, peak["bytes"], sum(counter.values()),
            on_host, reduction["bytes"]]


def paper_bytes(mode: str, psi: int, n: int) -> float:
    """Rajbhandari et al. 2020 §5 with K = 12: per-rank model-state bytes."""
    return {"plain": 16 * psi, "zero1": (4 + 12 / n) * psi, "zero2": (2 + 14 / n) * psi,
            "zero3": 16 * psi / n, "zero3+offload": 16 * psi / n}[mode]


def closed_traffic(mode: str, n: int, psi_bf16: float) -> float:
    """Ring wire bytes per rank per step (the ZeRO paper's §7): plain DP and ZeRO-1 move
    2(N-1)/N x the bf16 gradients; ZeRO-2 one all-gather of the parameters and one
    reduce-scatter of the gradients, the same; ZeRO-3 all-gathers every unit again in
    backward: 3(N-1)/N, 1.5x."""
    return (3 if mode.startswith("zero3") else 2) * (n - 1) / n * psi_bf16


def check(row: str, name: str, expected: float, actual: float, tolerance: float = 1e-9):
    """Stop non-zero when a measured figure breaks the claim docs/benchmarks.md makes of it."""
    if abs(actual - expected) > tolerance * max(abs(expected), 1.0):
        raise SystemExit(f"{row}: {name} is {actual:,.1f}, expected {expected:,.1f}")


def check_row(dp: int, mode: str, psi: int, measured: dict):
    """The doc's claims: persistent bytes are the paper's (ZeRO-2: 16Ψ/N, FSDP2 reshards
    after the backward), the planner's equal them, its gathered bytes equal the measured
    peak wherever FSDP2 gathers, the traffic is the closed form, ZeRO-3 moves 1.5x plain."""
    row = f"DP {dp} {mode}"
    paper = paper_bytes("zero3" if mode == "zero2" else mode, psi, dp)
    check(row, "total bytes against the paper", paper, measured["total"])
    check(row, "planner bytes against measured", measured["total"], measured["planned"])
    if dp > 1:
        check(row, "gathered bytes against planned", measured["planned gathered"],
              measured["gathered"])
        if measured["planned reducing"] is not None:
            check(row, "reduction bytes against planned", measured["planned reducing"],
                  measured["reducing"])
        check(row, "DP bytes/step against closed form", measured["closed"], measured["traffic"])
        check(row, "DP bytes/step x plain", 1.5 if mode.startswith("zero3") else 1.0,
              measured["traffic"] / measured["plain traffic"])


def planner(mode: str, dp: int):
    config = validate_model_args(parse_args(PLANNER_FLAGS + MODE_FLAGS[mode]), dp)
    return weights_and_optimizer(config, 0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_flag(p)
    device = p.parse_args().device
    print(f"bf16 compute parameters and gradients, fp32 Adam state; MiB per rank (rank 0); "
          f"on {describe(device)}")
    print(f"{'DP':>2} {'mode':>13} {'params':>7} {'grads':>7} {'optim':>7} {'total':>7} "
          f"{'paper':>7} {'planner':>7} {'gathered':>8} {'planned':>8} {'host':>7} | "
          f"{'DP MiB/step':>11} "
          f"{'closed':>7} {'ratio':>5} {'x plain':>7}")
    mib = 2.0 ** 20
    for dp in (1, 2, 4):
        if device == "cuda" and dp > torch.cuda.device_count():
            print(f"{dp:>2} skipped: needs {dp} GPUs (one rank per GPU under NCCL)")
            continue
        plain_traffic = None
        for mode in MODES:
            psi, params, grads, optim, gathered, traffic, on_host, reducing = \
                launch(dp, worker, mode, device, device_type=device)[0]
            plan = planner(mode, dp)
            host = params + grads + optim if on_host else 0
            total = params + grads + optim
            # The planner's persistent bytes (GPU + host), less the transient gathers and
            # reduction.
            planned = plan["parameters"] + plan["gradients"] + plan["optimizer_state"] + \
                plan.get("host", 0) - plan.get("gathered", 0) - plan.get("reducing", 0)
            closed = closed_traffic(mode, dp, 2 * psi)
            plain_traffic = traffic if mode == "plain" else plain_traffic
            ratio = f"{traffic / closed:5.3f}" if closed else "  -  "
            vs = f"{traffic / plain_traffic:7.3f}" if plain_traffic else "    -  "
            print(f"{dp:>2} {mode:>13} {params / mib:7.3f} {grads / mib:7.3f} "
                  f"{optim / mib:7.3f} {total / mib:7.3f} {paper_bytes(mode, psi, dp) / mib:7.3f} "
                  f"{planned / mib:7.3f} {gathered / mib:8.3f} "
                  f"{plan.get('gathered', 0) / mib:8.3f} {host / mib:7.3f} | "
                  f"{traffic / mib:11.3f} {closed / mib:7.3f} {ratio} {vs}")
            check_row(dp, mode, psi, {"total": total, "planned": planned, "gathered": gathered,
                                      "planned gathered": plan.get("gathered", 0),
                                      "reducing": reducing,
                                      "planned reducing": plan.get("reducing"),
                                      "traffic": traffic, "closed": closed,
                                      "plain traffic": plain_traffic})
    print(f"Ψ = {psi:,} parameters")


if __name__ == "__main__":
    main()
