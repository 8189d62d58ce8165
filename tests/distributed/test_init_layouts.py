"""Initial weights at TP and PP layouts against the single-process model on the same device
type (docs/design.md §3): every parameter, its TP shards gathered, equals the single-process one
exactly, vocabulary padding rows are zero, and a bf16 model holds the fp32 values rounded."""

import dataclasses

import pytest
import torch

from megalite.validation import pad_vocab_size
from megalite.model.gpt import build_model_chunks
from megalite.parallel_state import ParallelState, RankGrid
from megalite.spawn import run_distributed
from megalite.tensor_parallel.params import VOCAB_PARAMS, is_embedding_copy

from tests.helpers import LLAMA_STYLE, gather_tensor_parallel, tiny_gpt_config

pytestmark = pytest.mark.slow  # every test here launches processes

VOCAB = 101
BASE = tiny_gpt_config(num_layers=4, num_query_groups=2, seq_length=16,
                       padded_vocab_size=pad_vocab_size(VOCAB, 8, 1), vocab_size=VOCAB,
                       attention_dropout=0.1, hidden_dropout=0.1)
STYLES = {"gpt2": {}, "llama": LLAMA_STYLE}
LAYOUTS = [(2, 1, 1), (1, 2, 2)]  # (TP, PP, virtual stages) on 2 ranks


def compare(rank, world_size, device: str) -> list[str]:
    problems = []
    for style, tp, pp, v, dtype in [(s, *layout, d) for s in STYLES for layout in LAYOUTS
                                    for d in (torch.float32, torch.bfloat16)]:
        state = ParallelState(RankGrid(world_size, tp, pp), rank)
        ref_config = dataclasses.replace(BASE, **STYLES[style])
        config = dataclasses.replace(ref_config, sequence_parallel=tp > 1,
                                     padded_vocab_size=pad_vocab_size(VOCAB, 8, tp))
        # Today's bf16 weights: the fp32 single-process model's, rounded once.
        reference = build_model_chunks(ref_config, 4, device=device).to(dtype)[0]
        reference = {n: p.detach().float().cpu() for n, p in reference.named_parameters()}
        chunks = build_model_chunks(config, 4, state.pp_rank, pp, v, state.tp_group,
                                    device=device, dtype=dtype)
        for name, param in chunks.named_parameters():
            where = f"{style} TP={tp} PP={pp} v={v} {dtype} {name}"
            if param.device.type != device or param.dtype != dtype:
                problems.append(f"{where}: built on {param.device} in {param.dtype}")
            full = gather_tensor_parallel(param.detach().float().cpu(), param, state.tp_group)
            ref_name = name.split(".", 1)[1]
            if is_embedding_copy(param):
                ref_name = "embedding.word_embeddings.weight"
            ref = reference[ref_name]
            # Vocabulary rows: the real ones equal, the padding (which depends on TP) zero.
            rows = VOCAB if ref_name.endswith(VOCAB_PARAMS) else ref.shape[0]
            if full.shape[1:] != ref.shape[1:] or full.shape[0] < rows or full[rows:].any():
                problems.append(f"{where}: shape {tuple(full.shape)} or padding rows not zero")
            elif not torch.equal(full[:rows], ref[:rows]):
                problems.append(f"{where}: differs from the single-process weight")
    return problems


def check(device: str):
    results = run_distributed(2, compare, device, timeout=300)
    failures = [problem for result in results for problem in result]
    assert not failures, failures


def test_initial_weights_equal_single_process_at_every_layout_on_cpu():
    check("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_initial_weights_equal_single_process_at_every_layout_on_cuda():
    # Both ranks on one GPU: building needs no collective on the device.
    check("cuda")
