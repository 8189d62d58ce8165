"""The memory planner (megalite/memory_estimate/, tools/estimate_memory.py) against
independent references: the ZeRO paper's worked example, Megatron's count of micro-batches
in flight, the parameters and gradient buckets of the real model, and bytes counted on
the tensors of small CPU runs: after one real training step for the parameters, gradients
and optimizer state (issue 8: within 10%), and the tensors autograd saves for one
micro-batch's backward for the activations (within 25%). The activation model is the
planner's CPU one (CPU kernels save a few things differently from CUDA ones: see `DEVICES`
in the planner), of eager layers; test_memory_estimate_compiled.py checks compiled ones.

Flash-style SDPA on the CPU falls back to the math kernel (which keeps the s x s
probabilities) when attention dropout is on, unlike the CUDA kernels, so the SDPA cases
here run without attention dropout; the `unfused` cases keep it.
"""

import importlib.util
import os
import re
import subprocess
import types
from pathlib import Path

import pytest
import torch

from megalite import memory_estimate as me
from megalite.arguments import parse_args
from megalite.validation import validate_args
from megalite.data.sampler import add_mtp_targets
from megalite.documents import Documents
from megalite.memory_estimate import documents as document_plan
from megalite.memory_estimate.activations import DEVICES, _shapes, layer_activation_bytes
from megalite.memory_estimate.schedule import sends_held
from megalite.memory_estimate.weights import grad_buckets
from megalite.model.gpt import GPTModel, build_model_chunks
from megalite.parallel_state import ParallelState, RankGrid
from megalite.pipeline_parallel.schedules import BACKWARD, FORWARD, WEIGHT, build_schedule
from megalite.spawn import run_distributed
from megalite.tensor_parallel.params import is_embedding_copy, is_shared_embedding, partition_dim
from megalite.train_step import StepRunner, autocast
from megalite.training import build_model, build_optimizer

from tests.helpers import (document_starts, flags_with, measured_chunk_bytes, planned_chunk_bytes,
                           without)

ROOT = Path(__file__).resolve().parents[1]
STATE_TOLERANCE = 0.10        # params, grads, optimizer state (issue 8)
ACTIVATION_TOLERANCE = 0.25   # activations (issue 8)
CPU = torch.device("cpu")

TINY = flags_with("--attention-dropout", "0", vocab_size=500, num_layers=4,
                  micro_batch_size=2)
ROPE_GQA = ["--position-embedding-type", "rope", "--group-query-attention",
            "--num-query-groups", "2"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", *ROPE_GQA,
         "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "192"]
# DeepSeek-style multi-latent attention (Llama's MLP and norms; no GQA, refused with MLA).
MLA = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
       "--ffn-hidden-size", "192", "--multi-latent-attention", "--kv-lora-rank", "24",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]
LATENT_NORMS = ["--q-lora-rank", "32", "--qk-layernorm"]


def make_config(flags, world_size=1):
    return validate_args(parse_args(TINY + flags), world_size)


def storage_bytes(tensors, exclude=frozenset()) -> int:
    """Bytes of the distinct storages behind `tensors` (each counted once)."""
    seen = {}
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            seen[ptr] = t.untyped_storage().nbytes()
    return sum(seen.values())


def ptrs(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


# The ZeRO paper's worked example.

def test_zero_paper_worked_example():
    """Rajbhandari et al. 2020, §1 and Figure 1: Ψ = 7.5B parameters, N_d = 64 data-
    parallel ranks, mixed-precision Adam with K = 12 bytes of optimizer state per
    parameter, GB = 1e9 bytes, per device:

        baseline DP   (2 + 2 + K) Ψ        = 16 x 7.5e9          = 120 GB
        P_os          2Ψ + 2Ψ + KΨ / N_d   = (4 + 12/64) x 7.5e9 = 31.4 GB
        P_os+g        2Ψ + (2 + K)Ψ / N_d  = (2 + 14/64) x 7.5e9 = 16.6 GB
        P_os+g+p      (2 + 2 + K)Ψ / N_d   = (16/64) x 7.5e9     = 1.9 GB

    A GPT of 36 layers, hidden 4096, 2048 learned positions and a 59008-token vocabulary
    has Ψ = 36 (12h² + 13h) + 2h + (59008 + 2048) h = 7,499,767,808. With --fp16 (the
    paper's mixed precision; --bf16 accumulates gradients in fp32, as Megatron does), megalite
    keeps 2 bytes of parameters, 2 of gradients and 12 of fp32 main parameters and Adam
    moments per parameter; --use-distributed-optimizer is P_os. The planner's parameters
    + gradients + optimizer state must give the first two figures; megalite has no P_os+g
    or P_os+g+p, whose figures follow from the planner's baseline components sharded as
    the paper shards them. The fp32 gradient copies of the optimizer step (4 bytes per
    owned parameter) are outside the paper's count.
    """
    flags = ["--num-layers", "36", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--seq-length", "2048", "--max-position-embeddings", "2048", "--mock-data",
             "--vocab-size", "59008", "--micro-batch-size", "1", "--global-batch-size", "64",
             "--train-iters", "1", "--lr", "1e-4", "--fp16"]
    h = 4096
    psi = 36 * (12 * h * h + 13 * h) + 2 * h + (59008 + 2048) * h
    baseline = validate_args(parse_args(flags), 64)
    zero1 = validate_args(parse_args(flags + ["--use-distributed-optimizer"]), 64)
    assert me.num_model_parameters(baseline) == psi == 7_499_767_808

    def gb(config):
        r = me.estimate_rank_memory(config, 0)
        return (r.parameters + r.gradients + r.optimizer_state) / 1e9
    assert round(gb(baseline), 1) == 120.0
    assert round(gb(zero1), 1) == 31.4
    r = me.estimate_rank_memory(baseline, 0)
    assert round((r.parameters + (r.gradients + r.optimizer_state) / 64) / 1e9, 1) == 16.6
    assert round((r.parameters + r.gradients + r.optimizer_state) / 64 / 1e9, 1) == 1.9
    assert me.estimate_rank_memory(zero1, 0).main_grads == pytest.approx(4 * psi / 64, rel=1e-6)


# Micro-batches in flight: Narayanan et al. 2021 and Megatron's theoretical memory.

@pytest.mark.parametrize("p", [2, 4, 8])
def test_1f1b_keeps_p_minus_rank_microbatches_in_flight(p):
    for m in (1, p - 1, p, 2 * p, 4 * p):
        for r in range(p):
            assert me.microbatches_in_flight(p, r, m) == min(p - r, m), (p, r, m)


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (2, 4), (8, 4)])
def test_interleaved_in_flight_on_the_first_stage_matches_megatron(p, v):
    """Megatron (theoretical_memory_usage.py) counts p micro-batches in flight on the
    first stage, times 1 + (p-1)/(p v) under interleaving: in chunk units p v + p - 1.
    With m = p megalite runs every forward first (m v chunks in flight)."""
    for m in (2 * p, 4 * p):
        assert me.microbatches_in_flight(p, 0, m, v) == p * v + p - 1
    assert me.microbatches_in_flight(p, 0, p, v) == p * v


# Parameters: the planner's meta-device build is the model, and its buckets the buffer's.

@pytest.mark.parametrize("flags,pp,v", [
    ([], 1, 1), (LLAMA, 1, 1), (["--untie-embeddings-and-output-weights"], 2, 1),
    ([], 2, 2), (LLAMA, 2, 2),
])
def test_rank_parameters_are_the_models(flags, pp, v):
    extra = ["--pipeline-model-parallel-size", str(pp)]
    if v > 1:
        extra += ["--num-layers-per-virtual-pipeline-stage", str(4 // (pp * v))]
    config = make_config(flags + extra, pp)

    def described(params):
        return [(p.shape, is_shared_embedding(p), is_embedding_copy(p), partition_dim(p))
                for p in params]
    for rank in range(pp):
        model = build_model_chunks(config.model, 1, rank, pp, v)
        planned = me.rank_parameters(config, rank)
        assert all(q.is_meta for q in planned)
        assert described(planned) == described(model.parameters())
    assert me.num_model_parameters(config) == sum(
        p.numel() for p in GPTModel(config.model, 1).parameters())


def built_buckets(grad_buffer) -> list[tuple[int, int]]:
    """(real, padded) elements of each bucket of a real gradient buffer."""
    return [(sum(p.numel() for p in b.params), b.numel) for b in grad_buffer.buckets]


def planned_buckets(config) -> list[tuple[int, int]]:
    return grad_buckets(config, me.rank_parameters(config, 0))


# Parameters, gradients and optimizer state after one real training step.

def microbatches(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, m = config.training, config.model
    out = []
    for _ in range(t.num_microbatches):
        tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1),
                               generator=g)
        out.append(add_mtp_targets({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                                    "loss_mask": torch.ones(t.micro_batch_size, m.seq_length)},
                                   m.mtp_depths))
    return out


def train_one_step(config, state=None):
    """build_model + build_optimizer as pretrain() does, then one StepRunner step."""
    state = state or ParallelState.single_process()
    model = build_model(config, state, CPU, None)
    optimizer, grad_buffer = build_optimizer(model, config, state)
    runner = StepRunner(model, optimizer, config, state, CPU, grad_buffer)
    runner.train_step(microbatches(config))
    return model, optimizer, grad_buffer, runner


def measured_state(model, optimizer, grad_buffer) -> dict:
    """Bytes read off the tensors: parameter storages (flat buffers under the distributed
    optimizer), gradient buckets, Adam's tensors plus the fp32 main parameters it steps
    when they are not the model's, and the fp32 gradients the step attached to them."""
    params = list(model.parameters())
    flats = [b.flat for b in grad_buffer.buckets]
    model_memory = ptrs(params) | ptrs(flats)
    stepped = [q for group in optimizer.adam.param_groups for q in group["params"]]
    adam = [v for q in stepped for v in optimizer.adam.state.get(q, {}).values()
            if torch.is_tensor(v) and v.dim() > 0]
    return {"parameters": storage_bytes(params), "gradients": storage_bytes(flats),
            "optimizer_state": storage_bytes(stepped + adam, model_memory),
            "main_grads": storage_bytes([q.grad for q in stepped if q.grad is not None],
                                        model_memory)}


def assert_state_close(measured: dict, planned: me.RankMemory):
    for key, value in measured.items():
        assert getattr(planned, key) == pytest.approx(value, rel=STATE_TOLERANCE, abs=0), key


@pytest.mark.parametrize("flags", [
    [],                                                     # fp32: plain AdamW
    ["--use-distributed-optimizer"],                        # fp32 main copies (ZeRO, DP 1)
    ["--bf16"],                                             # bf16 + fp32 main params
    ["--bf16", "--accumulate-allreduce-grads-in-fp32"] + LLAMA,
    ["--fp16", "--loss-scale", "128", "--ddp-bucket-size", "20000"],
    ["--bf16"] + MLA + LATENT_NORMS,
    ["--bf16", "--mtp-num-layers", "2"] + LLAMA,            # the MTP depths' weights
])
def test_weights_and_optimizer_state_match_one_step(flags):
    config = make_config(flags)
    model, optimizer, grad_buffer, _ = train_one_step(config)
    assert built_buckets(grad_buffer) == planned_buckets(config)
    assert_state_close(measured_state(model, optimizer, grad_buffer),
                       me.estimate_rank_memory(config, 0, "cpu"))


# Activations: what one micro-batch's forward saves for backward.

ACTIVATION_CASES = {
    "gpt fp32": [],
    "gpt bf16": ["--bf16"],
    "llama bf16": ["--bf16", "--hidden-dropout", "0.1"] + LLAMA,
    "llama fp32 tied, no dropout": ["--normalization", "RMSNorm", "--swiglu", *ROPE_GQA,
                                    "--hidden-dropout", "0"],
    "unfused bf16, attention dropout": ["--bf16", "--attention-backend", "unfused",
                                        "--attention-dropout", "0.1"],
    "unfused fp32 gqa rope": ["--attention-backend", "unfused", *ROPE_GQA],
    "pp2 interleaved fp32": ["--pipeline-model-parallel-size", "2",
                             "--num-layers-per-virtual-pipeline-stage", "1"],
    "pp2 llama bf16": ["--pipeline-model-parallel-size", "2", "--bf16"] + LLAMA,
    # FP8 copies of the linear layers' inputs and weights instead of the inputs (tensorwise),
    # the inputs themselves (rowwise); the first and last layers without FP8.
    "llama bf16 fp8 tensorwise": ["--bf16", "--fp8-format", "hybrid"] + LLAMA,
    "gpt fp32 fp8 rowwise, first and last bf16": [
        "--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--first-last-layers-bf16"],
    "pp2 gpt fp32 fp8 tensorwise, first and last bf16": [
        "--pipeline-model-parallel-size", "2", "--fp8-format", "e4m3",
        "--first-last-layers-bf16"],
    # MoE layers (memory_estimate/moe.py): routed experts, shared experts, capacity padding.
    "moe llama bf16 shared experts": ["--bf16", "--num-experts", "4", "--moe-ffn-hidden-size",
                                      "96", "--moe-shared-expert-intermediate-size", "64",
                                      "--moe-layer-freq", "2"] + LLAMA,
    "moe gpt fp32 padded to capacity": ["--disable-bias-linear", "--num-experts", "4",
                                        "--moe-router-topk", "1", "--moe-expert-capacity-factor",
                                        "1.5", "--moe-pad-expert-input-to-capacity"],
    # Multi-token prediction: D depths on the last stage, with the embedding's copy there.
    "mtp 2 llama fp32": ["--mtp-num-layers", "2"] + LLAMA,
    "pp2 mtp 1 llama bf16 tied": ["--pipeline-model-parallel-size", "2", "--bf16",
                                  "--mtp-num-layers", "1",
                                  *without(LLAMA, "--untie-embeddings-and-output-weights")],
}
RECOMPUTE_CASES = {
    "selective bf16": ["--bf16", "--recompute-granularity", "selective"],
    "selective unfused fp32": ["--attention-backend", "unfused",
                               "--recompute-granularity", "selective"],
    "full uniform 2": ["--bf16", "--recompute-granularity", "full",
                       "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    "full block 1 llama": ["--bf16", "--recompute-granularity", "full",
                           "--recompute-method", "block", "--recompute-num-layers", "1"] + LLAMA,
    "pp2 full uniform llama": ["--pipeline-model-parallel-size", "2", "--bf16",
                               "--recompute-granularity", "full", "--recompute-method",
                               "uniform", "--recompute-num-layers", "1"] + LLAMA,
}


def check_activations(flags):
    config = make_config(flags, 2 if "--pipeline-model-parallel-size" in flags else 1)
    for rank in range(config.parallel.pipeline_model_parallel_size):
        measured, planned = measured_chunk_bytes(config, rank), planned_chunk_bytes(config, rank)
        for got, want in zip(measured, planned):
            assert want == pytest.approx(got, rel=ACTIVATION_TOLERANCE), (rank, measured, planned)


@pytest.mark.parametrize("name", ACTIVATION_CASES)
def test_activations_match_saved_tensors(name):
    check_activations(ACTIVATION_CASES[name])


@pytest.mark.parametrize("name", RECOMPUTE_CASES)
def test_activations_with_recompute_match_saved_tensors(name):
    check_activations(RECOMPUTE_CASES[name])


# The document flags (memory_estimate/documents.py): samples of 64 tokens, the documents of
# tests.helpers.DOCUMENT_LENGTHS (long, short and cut ones).
DOCUMENT_CASES = {
    "documents sdpa fp32 learned": ["--reset-attention-mask", "--reset-position-ids"],
    "documents sdpa llama bf16": ["--bf16", "--dataloader-inter-document-masking"] + LLAMA,
    "documents unfused fp32 rope gqa": ["--attention-backend", "unfused",
                                        "--dataloader-inter-document-masking", *ROPE_GQA],
    "documents unfused bf16 learned, attention dropout": [
        "--bf16", "--attention-backend", "unfused", "--attention-dropout", "0.1",
        "--reset-attention-mask", "--reset-position-ids"],
    "positions only, rope": ["--reset-position-ids", *ROPE_GQA],
}


@pytest.mark.parametrize("name", DOCUMENT_CASES)
def test_document_activations_match_saved_tensors(name, monkeypatch):
    """With documents the planner counts exactly what autograd saves (the per-sample RoPE
    table, [b, s] position ids, each sample's unfused mask, SDPA's padded batches) once it
    is told how many rows the micro-batch's documents pad to; without the data it plans
    an upper bound of those rows (document_plan.padded_rows), which must be at least the
    real count and keep the chunk within the activation tolerance."""
    config = make_config(["--seq-length", "64", "--max-position-embeddings", "64"]
                         + DOCUMENT_CASES[name])
    measured, bound = measured_chunk_bytes(config, 0), planned_chunk_bytes(config, 0)
    starts = document_starts(config.training.micro_batch_size, 64)
    batches = Documents(starts, torch.arange(64)).padded_batches(64)
    rows = sum(n * length for n, length in batches.shapes)
    assert document_plan.padded_rows(_shapes(config, DEVICES["cpu"])) >= rows
    monkeypatch.setattr(document_plan, "padded_rows", lambda shape: rows)
    assert planned_chunk_bytes(config, 0) == measured
    assert measured[0] <= bound[0] <= (1 + ACTIVATION_TOLERANCE) * measured[0]


# Multi-latent attention and QK-norm (memory_estimate/mla.py): counted exactly, every
# tensor autograd saves, the CPU SDPA's math fallback for MLA's unequal head sizes included.
EXACT_CASES = {
    "mla fp32 query latent, latent norms": MLA + LATENT_NORMS,
    "mla bf16 query latent, latent LayerNorms": ["--bf16", "--normalization", "LayerNorm"]
                                                + MLA + LATENT_NORMS,
    "mla bf16 no query latent, no norms": ["--bf16"] + MLA,
    "mla bf16 selective": ["--bf16", "--recompute-granularity", "selective"] + MLA
                          + LATENT_NORMS,
    "mla unfused fp32": ["--attention-backend", "unfused"] + MLA + LATENT_NORMS,
    "qk-norm llama fp32": ["--qk-layernorm"] + LLAMA,
    "qk-norm llama bf16": ["--bf16", "--qk-layernorm"] + LLAMA,
    "qk-norm gpt bf16 gqa": ["--bf16", "--qk-layernorm", *ROPE_GQA],
}


@pytest.mark.parametrize("name", EXACT_CASES)
def test_mla_and_qk_norm_activations_are_the_saved_tensors(name):
    config = make_config(EXACT_CASES[name])
    assert planned_chunk_bytes(config, 0) == measured_chunk_bytes(config, 0)


def test_recompute_shrinks_activations():
    """Full recompute keeps one [s, b, h] input per group: far less than every layer's
    tensors; selective keeps a little less than none (flash attention saves little).
    Eager layers for all three, so they compare like with like (the planner's CUDA
    default compiles none and full, never selective: config.compile_by_default)."""
    def per_microbatch(flags):
        config = make_config(flags + ["--no-compile-layers"])
        return me.estimate_rank_memory(config, 0).activations_per_microbatch
    none = per_microbatch(["--bf16"])
    full = per_microbatch(["--bf16", "--recompute-granularity", "full",
                           "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    selective = per_microbatch(["--bf16", "--recompute-granularity", "selective"])
    assert full < none / 4 and selective < none


GPU_FLAGS = ["--mock-data", "--vocab-size", "32000", "--num-layers", "2", "--hidden-size",
             "1024", "--num-attention-heads", "16", "--seq-length", "1024",
             "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-4", "--bf16"]


def cuda_forward_bytes(config, warm_up: bool = False) -> int:
    """Memory allocated on the GPU by one micro-batch's forward, kept for backward (the
    loss too). `warm_up`: a forward and backward first, so compiled layers compile outside
    the measurement."""
    cuda = torch.device("cuda")
    groups = types.SimpleNamespace(pp_rank=0, pp_size=1, tp_group=None, cp_group=None,
                                   ep_group=None)
    chunk = build_model(config, groups, cuda, None)[0]
    chunk.train()
    _ = chunk.rope_table(cuda)  # the model's cached RoPE angles are not activations
    tokens = torch.randint(0, 32000, (2, 1024), device=cuda)
    for _ in range(1 if warm_up else 0):
        with autocast(config.precision, cuda):
            chunk(tokens, tokens).float().sum().backward()
        chunk.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with autocast(config.precision, cuda):
        losses = chunk(tokens, tokens)
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated() - before
    del losses
    return used


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: checks the planner's CUDA activation model")
@pytest.mark.parametrize("flags", [[], ["--attention-dropout", "0.1"], LLAMA])
def test_cuda_activations_match_allocated_memory(flags):
    """On a GPU: memory allocated by one micro-batch's forward (kept for backward) against
    the CUDA model of eager layers (bool dropout masks, fp32 LayerNorm under autocast, the
    attention output copied for the projection). Tensors of MBs, so allocator rounding is
    noise."""
    config = validate_args(parse_args(GPU_FLAGS + flags + ["--no-compile-layers"]), 1)
    assert planned_chunk_bytes(config, 0, "cuda")[0] == pytest.approx(
        cuda_forward_bytes(config), rel=ACTIVATION_TOLERANCE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: checks the "
                    "planner's model of layers compiled by inductor (the default on a GPU)")
@pytest.mark.slow  # inductor starts its compile workers (processes)
@pytest.mark.parametrize("flags", [[], ["--attention-dropout", "0.1"], LLAMA,
                                   LLAMA + ["--hidden-dropout", "0.1"]])
def test_cuda_compiled_activations_match_allocated_memory(flags):
    """The twin of the test above with the default flags, so layers compiled by inductor
    (test_memory_estimate_compiled.py checks the partition on a CPU). One layer's bytes
    are the difference between 4 and 2 layers, within 5% of
    activations.compiled_layer_saved_bytes (the fp32 LayerNorm statistics of CUDA
    autocast, the attention output not copied: the partitioner recomputes the copy);
    the whole chunk within the eager test's tolerance."""
    torch._dynamo.reset()
    configs = [validate_args(parse_args(without(GPU_FLAGS, "--num-layers") + flags
                                        + ["--num-layers", str(n)]), 1) for n in (2, 4)]
    assert all(config.layers_compiled("cuda") for config in configs)
    used = [cuda_forward_bytes(config, warm_up=True) for config in configs]
    layer, _ = layer_activation_bytes(configs[0], me.DEVICES["cuda"])
    assert layer == pytest.approx((used[1] - used[0]) / 2, rel=0.05)
    assert planned_chunk_bytes(configs[0], 0, "cuda")[0] == pytest.approx(
        used[0], rel=ACTIVATION_TOLERANCE)


# Two ranks: tensor (and sequence) parallelism, ZeRO-1 over DP 2, pipeline send buffers.

TP_CASES = {"gpt bf16 tp2": ["--bf16"], "gpt fp32 tp2 sp": ["--sequence-parallel"],
            "llama bf16 tp2 sp": ["--bf16", "--sequence-parallel"] + LLAMA}


def _tensor_parallel(rank, world_size) -> dict:
    state = ParallelState(RankGrid(world_size, 2, 1), rank)
    out = {}
    for name, flags in TP_CASES.items():
        config = make_config(["--tensor-model-parallel-size", "2"] + flags, world_size)
        model = build_model(config, state, CPU, None)
        sizes = [p.numel() for p in model.parameters()]
        out[name] = (measured_chunk_bytes(config, 0, state), planned_chunk_bytes(config, 0),
                     sizes, [me.shard_numel(config, q) for q in me.rank_parameters(config, 0)])
    return out


def _zero_over_two_ranks(rank, world_size) -> tuple[dict, me.RankMemory, bool]:
    """Measured state, planned state, and whether the buckets are the planner's."""
    config = make_config(["--bf16", "--use-distributed-optimizer", "--ddp-bucket-size",
                          "30000"], world_size)
    state = ParallelState(config.parallel.grid, rank)
    model, optimizer, grad_buffer, _ = train_one_step(config, state)
    return (measured_state(model, optimizer, grad_buffer), me.estimate_rank_memory(config, 0),
            built_buckets(grad_buffer) == planned_buckets(config))


def _pipeline_send_buffers(rank, world_size) -> tuple[int, int]:
    """Bytes of the sends still held when the step's last action is done (those in batches
    of sends only, which the executor waits for only then), against the planner's."""
    config = make_config(["--pipeline-model-parallel-size", "2", "--bf16"], world_size)
    state = ParallelState(config.parallel.grid, rank)
    held = []
    original = None

    def wait_all():
        held.append(sum(t.numel() * t.element_size()
                        for _, sends in runner.comm.pending for t in sends))
        original()
    model = build_model(config, state, CPU, None)
    optimizer, grad_buffer = build_optimizer(model, config, state)
    t = config.training
    runner = StepRunner(model, optimizer, config, state, CPU, grad_buffer)
    original, runner.comm.wait_all = runner.comm.wait_all, wait_all
    runner.train_step(microbatches(config))
    (chunk,) = me.rank_chunks(config, state.pp_rank, me.DEVICES["cpu"])
    send = {FORWARD: chunk.send_forward, BACKWARD: chunk.send_backward, WEIGHT: 0}
    actions = build_schedule(2, state.pp_rank, t.num_microbatches)
    return held[0], sum(send[a.kind] for a, keep in zip(actions, sends_held(config, state.pp_rank))
                        if keep)


def _two_rank_measurements(rank, world_size):
    return {"tp": _tensor_parallel(rank, world_size),
            "zero": _zero_over_two_ranks(rank, world_size),
            "pp": _pipeline_send_buffers(rank, world_size)}


@pytest.mark.slow
def test_two_rank_layouts_match_measurements():
    results = run_distributed(2, _two_rank_measurements, timeout=240)
    for rank, result in enumerate(results):
        for name, (measured, planned, sizes, planned_sizes) in result["tp"].items():
            assert sizes == planned_sizes, name
            for got, want in zip(measured, planned):
                assert want == pytest.approx(got, rel=ACTIVATION_TOLERANCE), (name, rank)
        held, planned = result["pp"]
        assert held == planned, rank
    measured, planned, same_buckets = results[0]["zero"]  # the planner reports DP rank 0
    assert same_buckets
    assert_state_close(measured, planned)
    # ZeRO-1 over DP 2: half the optimizer state of the same model without it.
    assert measured["optimizer_state"] < 0.55 * 12 * me.num_model_parameters(
        make_config(["--bf16"]))


# The tool and the example scripts.

def load_tool():
    spec = importlib.util.spec_from_file_location(
        "estimate_memory", ROOT / "tools" / "estimate_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tool_prints_a_row_per_pipeline_rank(capsys):
    tool = load_tool()
    argv = ["--world-size", "8", "--gpu-memory-gib", "40", "--bf16",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--sequence-parallel", "--use-distributed-optimizer",
            "--data-path", "unused", "--tokenizer-type", "GPT2BPETokenizer",
            "--tokenizer-vocab-size", "50257"] + without(TINY, "--mock-data", "--vocab-size")
    assert tool.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\| [01] \|", line)]
    assert len(rows) == 2
    assert "vocabulary 50304 (padded)" in out
    assert "TP 2 x PP 2 x DP 2" in out and "most loaded: PP rank" in out


@pytest.mark.parametrize("argv,message", [
    (["--world-size", "2", "--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size=3"),
    (["--world-size", "0"], "--world-size"),
    (["--world-size", "1", "--sequence-parallel", "--tensor-model-parallel-size", "1",
      "--seq-length", "0"], "--seq-length"),
])
def test_tool_rejects_invalid_flags(argv, message, capsys):
    assert load_tool().main(TINY + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


EXAMPLES = ["gpt2_125m.sh", "gpt2_350m.sh", "llama_1b.sh", "llama_7b.sh", "llama_13b_4x8.sh"]


def example_plan(script: str, tmp_path, capsys, **env) -> str:
    """The example's DRY_RUN=1 command line, run by the planner in this process: the
    script prints its planner arguments (PYTHON is a stub), so the flags tested are
    exactly the script's."""
    stub = tmp_path / "print_args"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    stub.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in ("DATA_PATH", "EXTRA_ARGS")}
    environ.update(DRY_RUN="1", PYTHON=str(stub), **env)
    done = subprocess.run(["bash", str(ROOT / "examples" / script)], env=environ,
                          capture_output=True, text=True, check=True)
    argv = done.stdout.splitlines()
    assert argv[0] == "tools/estimate_memory.py"
    capsys.readouterr()
    assert load_tool().main(argv[1:]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES)
def test_example_script_states_its_planned_memory(script, tmp_path, capsys):
    """Each example's run file states its layout, global batch and the planner's total per
    GPU; the planner run on the script's own flags must agree and fit an 80 GiB GPU."""
    text = (ROOT / "examples" / "configs" / script.replace(".sh", ".yaml")).read_text()
    header = re.search(r"Expected memory per GPU .*?: ([\d.]+) GiB total", text)
    batch = re.search(r"Global batch: (\d+) sequences", text)
    assert header and batch and "# Layout:" in text
    assert f"global-batch-size: {batch.group(1)}\n" in text
    out = example_plan(script, tmp_path, capsys)
    total = re.search(r"most loaded: PP rank \d+, total ([\d.]+) GiB of 80 GiB", out)
    assert total and total.group(1) == header.group(1), out
    assert float(total.group(1)) < 0.8 * 80


@pytest.mark.slow
def test_13b_needs_model_parallelism(tmp_path, capsys):
    """The 13B layout's justification: at TP 1 (DP 32, ZeRO-1) it does not fit."""
    out = example_plan("llama_13b_4x8.sh", tmp_path, capsys,
                       EXTRA_ARGS="--tensor-model-parallel-size 1")
    assert "does NOT fit" in out


def within(row: str, planned: int, measured: int, tolerance: float):
    """Stop non-zero when a printed row breaks the issue's bound (the tests assert it too)."""
    if abs(planned - measured) > tolerance * measured:
        raise SystemExit(f"{row}: planned {planned:,} bytes, measured {measured:,}: "
                         f"outside {tolerance:.0%}")


def print_comparison():
    """The measured-vs-planned tables of docs/benchmarks.md (issue 8); a row outside the
    issue's tolerance stops it non-zero."""
    from tests.test_memory_estimate import _two_rank_measurements
    print("| case | PP rank: chunks | measured bytes | planned bytes | planned / measured |")
    print("|---|---|---:|---:|---:|")
    cases = dict(ACTIVATION_CASES, **RECOMPUTE_CASES)
    rows = []
    for name, flags in cases.items():
        config = make_config(flags, 2 if "--pipeline-model-parallel-size" in flags else 1)
        for rank in range(config.parallel.pipeline_model_parallel_size):
            rows.append((name, rank, measured_chunk_bytes(config, rank),
                         planned_chunk_bytes(config, rank)))
    two_ranks = run_distributed(2, _two_rank_measurements)[0]  # one launch for both tables
    for name, (measured, planned, _, _) in two_ranks["tp"].items():
        rows.append((name, 0, measured, planned))
    for name, rank, measured, planned in rows:
        print(f"| {name} | {rank}: {len(measured)} | {sum(measured):,} | {sum(planned):,} "
              f"| {sum(planned) / sum(measured):.3f} |")
        for chunk, (got, want) in enumerate(zip(measured, planned)):
            within(f"{name}, PP rank {rank}, chunk {chunk}", want, got, ACTIVATION_TOLERANCE)
    print("\n| case | parameters | gradients | optimizer state | fp32 main grads |")
    print("|---|---:|---:|---:|---:|")
    state_cases = {"fp32, AdamW": [], "fp32, ZeRO-1 (DP 1)": ["--use-distributed-optimizer"],
                   "bf16": ["--bf16"],
                   "bf16, fp32 grads, llama": ["--bf16", "--accumulate-allreduce-grads-in-fp32"]
                   + LLAMA}
    results = []
    for name, flags in state_cases.items():
        config = make_config(flags)
        model, optimizer, grad_buffer, _ = train_one_step(config)
        results.append((name, measured_state(model, optimizer, grad_buffer),
                        me.estimate_rank_memory(config, 0, "cpu")))
    measured, planned, _ = two_ranks["zero"]
    results.append(("bf16, ZeRO-1 over DP 2 (rank 0)", measured, planned))
    for name, measured, planned in results:
        cells = [f"{planned_value:,} / {value:,}"
                 + (f" = {planned_value / value:.3f}" if value else "")
                 for key, value in measured.items()
                 for planned_value in [getattr(planned, key)]]
        print(f"| {name} | " + " | ".join(cells) + " |")
        for key, value in measured.items():
            within(f"{name}, {key}", getattr(planned, key), value, STATE_TOLERANCE)


if __name__ == "__main__":
    print_comparison()
