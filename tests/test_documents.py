"""Documents in packed samples (megalite/documents.py; docs/design.md §28): with
--reset-position-ids and --reset-attention-mask, every token of a packed sample gets the
logits its own document gets run alone through the one-process model (the independent
reference), on each attention backend a CPU runs, with RoPE and with learned positions."""

import numpy as np
import pytest
import torch

from megalite.arguments import parse_args
from megalite.attention_backends import core_attention, resolve_backend
from megalite.data.gpt_dataset import GPTDataset
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalite.data.mock import MockGPTDataset
from megalite.documents import Documents, starts_from_eod, starts_from_lengths
from megalite.errors import ConfigError
from megalite.model.gpt import GPTModel
from megalite.validation import validate_args

from tests.helpers import LLAMA_STYLE, flags_with, tiny_gpt_config

EOD = 63
# Three documents, each ending with its EOD token, and the cut-off start of a fourth.
DOCUMENTS = [[5, 9, 2, EOD], [7, EOD], [4, 4, 8, 1, 3, 6, EOD], [11, 12, 13]]
SEQ = sum(map(len, DOCUMENTS))
# The second sample holds them in another order (the cut-off document stays last).
ORDERS = (DOCUMENTS, [DOCUMENTS[2], DOCUMENTS[0], DOCUMENTS[1], DOCUMENTS[3]])


def megatron_starts(tokens: list[int], eod: int) -> list[int]:
    """Megatron's get_ltor_masks_and_position_ids, reset_position_ids: positions drop back
    to 0 after each EOD; a token's document start is its position minus that."""
    positions, prev = list(range(len(tokens))), 0
    for i, token in enumerate(tokens):
        if token == eod:
            for j in range(i + 1, len(tokens)):
                positions[j] -= i + 1 - prev
            prev = i + 1
    return [i - p for i, p in enumerate(positions)]


def test_starts_follow_megatrons_reset_position_ids():
    tokens = [t for doc in DOCUMENTS for t in doc]
    assert starts_from_eod(torch.tensor(tokens), EOD).tolist() == megatron_starts(tokens, EOD)
    # the dataset's own boundaries (its document index) give the same for these documents
    assert starts_from_lengths(list(map(len, DOCUMENTS)), SEQ).tolist() == \
        megatron_starts(tokens, EOD)
    no_boundary = torch.tensor([3, 4, 5, 6])
    assert starts_from_eod(no_boundary, EOD).tolist() == [0, 0, 0, 0]


# Multi-latent attention: its own RoPE table (YaRN past its original 4 positions) restarts
# per document too.
MLA = dict(LLAMA_STYLE, multi_latent_attention=True, position_embedding_type="none",
           q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
           kv_channels=12, qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=4.0,
           mscale_all_dim=1.0, yarn_original_max_position_embeddings=4)


@pytest.mark.parametrize("backend", ["unfused", "sdpa"])
@pytest.mark.parametrize("positions", ["rope", "learned_absolute", "mla"])
def test_each_token_sees_only_its_own_document(backend, positions):
    style = {"rope": LLAMA_STYLE, "mla": MLA}.get(positions, {})
    config = tiny_gpt_config(seq_length=SEQ, attention_backend=backend, num_query_groups=2,
                             reset_position_ids=True, reset_attention_mask=True,
                             **style)
    model = GPTModel(config, seed=3).eval()
    if positions == "mla":  # attention scores of order 1, so that its RoPE part shows
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in model.decoder.layers.values():
                for param in layer.self_attention.parameters():
                    param.normal_(0, 0.3, generator=generator)
    tokens = torch.tensor([[t for doc in order for t in doc] for order in ORDERS])
    starts = starts_from_eod(tokens, EOD)
    with torch.no_grad():
        packed = model(tokens, document_starts=starts)
        for sample, order in enumerate(ORDERS):
            begin = 0
            for doc in order:
                alone = model(torch.tensor([doc]))[0]
                torch.testing.assert_close(packed[sample, begin:begin + len(doc)], alone,
                                           rtol=0, atol=1e-5)
                begin += len(doc)
        # Without the starts the same model attends across documents: the check has teeth.
        assert not torch.allclose(model(tokens), packed, atol=1e-3)


def test_a_sample_without_a_boundary_is_plain_causal_attention():
    config = tiny_gpt_config(seq_length=SEQ, reset_position_ids=True,
                             reset_attention_mask=True, **LLAMA_STYLE)
    model = GPTModel(config, seed=3).eval()
    tokens = torch.randint(0, EOD, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, document_starts=starts_from_eod(tokens, EOD)),
                                   model(tokens), rtol=0, atol=1e-6)


def test_sdpa_per_document_matches_the_masked_reference_forward_and_backward():
    """The fast path (one SDPA call per document) against the unfused [b, s, s] mask, with
    GQA, including the gradients, and for a query block that is the end of its keys (how
    context parallelism's all_gather calls it)."""
    g = torch.Generator().manual_seed(0)
    b, s, heads, groups, d = 2, SEQ, 4, 2, 8
    q = torch.randn(b, s, heads, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, s, groups, d, generator=g, requires_grad=True) for _ in range(2))
    tokens = torch.randint(0, EOD - 1, (b, s), generator=g)
    tokens[0, [3, 5, 12]] = EOD
    tokens[1, [0, 7]] = EOD
    documents = Documents(starts_from_eod(tokens, EOD), torch.arange(s))
    grads = {}
    for backend in ("unfused", "sdpa"):
        out = core_attention(q, k, v, backend=backend, documents=documents)
        grads[backend] = (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))
        tail = core_attention(q[:, 9:], k, v, backend=backend,
                              documents=documents.rows(slice(9, s)))
        torch.testing.assert_close(tail, out[:, 9:], rtol=0, atol=1e-6)
    for mine, ref in zip(grads["sdpa"], grads["unfused"]):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)


def test_the_datasets_hand_each_sample_its_document_starts(tmp_path):
    """GPTDataset cuts samples across documents: starts from its EOD tokens and from its
    document index agree (each document ends with its EOD) and follow Megatron's rule;
    the mock corpus likewise."""
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    for length in rng.integers(1, 9, size=40):
        builder.add_document(np.append(rng.integers(0, EOD, size=length), EOD))
    builder.finalize(str(tmp_path / "d.idx"))
    indexed = IndexedDataset(str(tmp_path / "d"))
    by = {mode: GPTDataset(indexed, np.arange(40), 12, SEQ, 1, eod_token=EOD, documents=mode)
          for mode in ("eod", "index")}
    mocks = {mode: MockGPTDataset(6, SEQ, 12, 1, documents=mode) for mode in ("eod", "index")}
    for datasets, eod in ((by, EOD), (mocks, mocks["eod"].eod)):
        for i in range(6):
            sample = datasets["eod"][i]
            expected = megatron_starts(sample["tokens"].tolist(), eod)
            assert sample["document_starts"].tolist() == expected
            assert datasets["index"][i]["document_starts"].tolist() == expected
        assert any(datasets["eod"][i]["document_starts"].max() > 0 for i in range(6))


def test_a_document_mask_without_an_eod_token_or_with_a_kernel_that_cannot_is_refused(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    builder.add_document(np.arange(40))
    builder.finalize(str(tmp_path / "d.idx"))
    with pytest.raises(ConfigError, match="--reset-attention-mask.*end-of-document"):
        GPTDataset(IndexedDataset(str(tmp_path / "d")), np.arange(1), 2, SEQ, 1,
                   eod_token=None, documents="eod")
    mask = ["--reset-attention-mask", "--attention-dropout", "0"]
    with pytest.raises(ConfigError, match="--reset-attention-mask with --cp-comm-type p2p"):
        validate_args(parse_args(flags_with(*mask, "--attention-backend", "flash",
                                            "--context-parallel-size", "2")), 2)
    with pytest.raises(ConfigError, match="flex.*--attention-dropout"):
        validate_args(parse_args(flags_with("--attention-backend", "flex",
                                            "--attention-dropout", "0.1")), 1)
    with pytest.raises(ConfigError, match="flex.*cannot train on cpu"):
        resolve_backend("flex", torch.device("cpu"), torch.float32)
