"""The model is built where it will live (docs/design.md §3): on the target device, in the target
dtype, never first as a whole fp32 copy on the host. Checked by recording every tensor an
operator creates while the model is built."""

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.model.gpt import build_model_chunks
from megalite.tensor_parallel.params import (is_embedding_copy, is_sequence_parallel,
                                             is_shared_embedding, partition_dim)

from tests.helpers import tiny_gpt_config

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
