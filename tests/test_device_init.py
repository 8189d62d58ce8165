"""The model is built where it will live (docs/design.md §3): on the target device, in the target
dtype, never first as a whole fp32 copy on the host. Checked by recording every tensor an
operator creates while the model is built. FSDP2's model, built on `meta` and given storage by
to_empty, has the one-process model's buffers, on the device it computes on."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.arguments import parse_args
from megalite.model.gpt import GPTModel, build_model_chunks
from megalite.parallel_state import ParallelState, RankGrid
from megalite.tensor_parallel.params import (is_embedding_copy, is_sequence_parallel,
                                             is_shared_embedding, partition_dim)

from megalite.training import build_model
from megalite.validation import validate_args

from tests.helpers import flags_with, tiny_gpt_config

CONFIG = tiny_gpt_config(num_layers=4, num_query_groups=2, seq_length=16, padded_vocab_size=104,
                         vocab_size=101, attention_dropout=0.1, hidden_dropout=0.1,
                         sequence_parallel=True)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class HostFloatTensors(TorchDispatchMode):
    """Records the size of every floating-point tensor an operator creates on the CPU."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point():
                self.sizes.append(t.numel())
        return out


def build(device, dtype, pp_rank=0, pp_size=1, num_chunks=1):
    with HostFloatTensors() as host:
        chunks = build_model_chunks(CONFIG, 3, pp_rank, pp_size, num_chunks, device=device,
                                    dtype=dtype)
    return chunks, host.sizes


def tags(chunks) -> dict:
    return {name: (partition_dim(p), is_sequence_parallel(p), is_shared_embedding(p),
                   is_embedding_copy(p)) for name, p in chunks.named_parameters()}


def test_a_cpu_build_is_seen_on_the_host():
    """The recorder itself: a CPU build creates every weight on the host."""
    chunks, sizes = build("cpu", torch.float32)
    largest = max(p.numel() for p in chunks.parameters())
    assert largest in sizes


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_meta_build_has_shapes_and_tags_and_touches_no_host_memory(pp_rank):
    chunks, sizes = build("meta", torch.bfloat16, pp_rank, 2, 2)
    assert sizes == []
    reference = build_model_chunks(CONFIG, 3, pp_rank, 2, 2)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in chunks.parameters())
    assert {n: p.shape for n, p in chunks.named_parameters()} == \
        {n: p.shape for n, p in reference.named_parameters()}
    assert tags(chunks) == tags(reference)
    assert [chunk.stage for chunk in chunks] == [chunk.stage for chunk in reference]


def test_bf16_build_equals_the_fp32_build_rounded():
    """Today's bf16 weights: the fp32 initial values, rounded once."""
    chunks, _ = build("cpu", torch.bfloat16)
    expected = build_model_chunks(CONFIG, 3).to(torch.bfloat16)
    for (name, p), q in zip(chunks.named_parameters(), expected.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), name


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_build_never_holds_weights_on_the_host(dtype):
    chunks, sizes = build("cuda", dtype)
    assert sizes == []
    assert all(p.is_cuda and p.dtype == dtype for p in chunks.parameters())
    assert all(b.is_cuda for b in chunks.buffers())
    if dtype == torch.bfloat16:
        fp32, _ = build("cuda", torch.float32)
        for (name, p), q in zip(chunks.named_parameters(), fp32.parameters()):
            assert torch.equal(p, q.to(dtype)), name
    # Drawn by CUDA generators: not the CPU's values (the contract is per device type).
    cpu, _ = build("cpu", dtype)
    weight = "0.decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(dict(chunks.named_parameters())[weight].cpu(),
                           dict(cpu.named_parameters())[weight])


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ParallelState(RankGrid(1), 0)
    dist.destroy_process_group()


# MoE layers with the expert bias and its token counts, and a padded vocabulary: every buffer
# the model has.
MOE_EXPERT_BIAS = flags_with("--num-experts", "4", "--moe-router-topk", "2",
                             "--moe-router-score-function", "sigmoid",
                             "--moe-router-enable-expert-bias", "--disable-bias-linear",
                             vocab_size=61)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("offload", [False, True])
def test_fsdp2_buffers_are_the_one_process_models_on_the_compute_device(one_rank, device,
                                                                         offload):
    """to_empty leaves buffers without values (and, under --optimizer-cpu-offload, on the
    host, where the router's bias would meet the device's scores): each buffer, after
    FSDP2's build, against the model built in one process (issue 39, finding 3).
    Uninitialised memory is filled with NaN here, so a buffer left as to_empty made it
    shows."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        config = validate_args(parse_args(MOE_EXPERT_BIAS + ["--use-torch-fsdp2"] +
                                          ["--optimizer-cpu-offload"] * offload))
        chunks = build_model(config, one_rank, torch.device(device), None)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    reference = GPTModel(dataclasses.replace(config.model, compile_layers=False), seed=0)
    expected = dict(reference.named_buffers())
    assert expected.keys() == {n.split(".", 1)[1] for n, _ in chunks.named_buffers()}
    assert any(n.endswith("local_tokens_per_expert") for n in expected)
    for name, buffer in chunks.named_buffers():
        assert buffer.device.type == device, name
        assert buffer.dtype == expected[name.split(".", 1)[1]].dtype, name
        assert torch.equal(buffer.cpu(), expected[name.split(".", 1)[1]]), name
