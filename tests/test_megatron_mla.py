"""Megatron-LM multi-latent-attention checkpoints in and out (megalite/model/mla.py,
megalite/megatron_checkpoint/mla.py).

The reference is Megatron itself: tests/data/megatron_mla holds a 2-layer MLA model (query
LoRA, latent norms, YaRN RoPE evaluated past its original length) megatron.core wrote in both
its formats, and the logits its forward computed (README there).
"""

import argparse
import dataclasses
import re

import pytest
import torch

from megalite.arguments import parse_args
from megalite.checkpointing import saving
from megalite.checkpointing.model_fields import check_model_compatible
from megalite.errors import CheckpointError
from megalite.megatron_checkpoint import reader
from megalite.validation import validate_model_args

from tests.test_megatron_checkpoint import (LEGACY, ROOT, assert_renamed_keys_read_the_same,
                                            assert_torch_dist_matches, convert,
                                            export_and_reimport, logits, megalite_model,
                                            megatron_legacy, tool)

DATA = ROOT / "tests" / "data" / "megatron_mla"
REFERENCE = torch.load(DATA / "reference_logits.pt", weights_only=True)
# Megatron's MLATransformerConfig names its args under (megalite's flags are --yarn-*).
UNRECORDED = ("original_max_position_embeddings", "beta_fast", "beta_slow", "kv_channels")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_import_gives_megatrons_logits(tmp_path, fmt):
    assert convert("--import-megatron", DATA / fmt, "--save", tmp_path / "ckpt") == 0
    model = megalite_model(tmp_path / "ckpt")
    attention = model.decoder.layers["1"].self_attention
    assert attention.linear_kv_down_proj.weight.shape == (24, 64)  # kv_lora_rank + RoPE part
    assert model.config.yarn_original_max_position_embeddings == 16
    torch.testing.assert_close(logits(model, REFERENCE["tokens"]), REFERENCE["logits"],
                               atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_export_writes_megatrons_files_and_reimports_losslessly(tmp_path):
    export_and_reimport(tmp_path, DATA)
    # The three YaRN fields Megatron's script saved under MLATransformerConfig's names are
    # written under both; kv_channels is meaningless for MLA (refused with it).
    assert_torch_dist_matches(tmp_path / "megatron_torch_dist" / "iter_0000010",
                              DATA / "torch_dist" / "iter_0000010", UNRECORDED)
    legacy, megatrons = (megatron_legacy(d / LEGACY) for d in (tmp_path / "megatron_torch",
                                                              DATA / "torch"))
    assert list(legacy["model"]) == list(megatrons["model"])
    for name, t in megatrons["model"].items():
        assert (t is None and legacy["model"][name] is None) or \
            torch.equal(legacy["model"][name], t), name
    for name in ("original_max_position_embeddings", "beta_fast", "beta_slow", "q_lora_rank",
                 "rope_type", "mscale_all_dim"):
        assert getattr(legacy["args"], name) == getattr(megatrons["args"], name), name


def test_export_at_tp2_splits_heads_and_keeps_the_latents_whole(tmp_path):
    """TP 2: the up-projections split by heads (rows), linear_proj by columns, the
    down-projections and latent norms whole on each rank (Transformer Engine's duplicated
    linears); read back, the same logits."""
    assert convert("--import-megatron", DATA / "torch", "--save", tmp_path / "a") == 0
    assert convert("--load", tmp_path / "a", "--export-megatron", tmp_path / "m",
                   "--ckpt-format", "torch", "--target-tensor-parallel-size", "2") == 0
    whole = megatron_legacy(DATA / "torch" / LEGACY)["model"]
    prefix = "decoder.layers.0.self_attention."
    for rank in range(2):
        shard = megatron_legacy(tmp_path / f"m/iter_0000010/mp_rank_{rank:02d}/"
                                "model_optim_rng.pt")["model"]
        for name, dim in (("linear_q_up_proj", 0), ("linear_kv_up_proj", 0), ("linear_proj", 1)):
            expected = whole[f"{prefix}{name}.weight"].chunk(2, dim=dim)[rank]
            assert torch.equal(shard[f"{prefix}{name}.weight"], expected), name
        for name in ("linear_q_down_proj.weight", "linear_kv_down_proj.weight",
                     "q_layernorm.weight", "kv_layernorm.weight"):
            assert torch.equal(shard[prefix + name], whole[prefix + name]), name
    assert convert("--import-megatron", tmp_path / "m", "--save", tmp_path / "b") == 0
    torch.testing.assert_close(logits(megalite_model(tmp_path / "b"), REFERENCE["tokens"]),
                               REFERENCE["logits"], atol=1e-5, rtol=0)


def save_local_spec_tp2(out):
    """Megatron's local spec at TP 2, cut here by hand as it shards: every linear of the
    attention column-parallel (rows), the down-projections too, linear_proj and fc2 by
    columns, fc1 as [gate half r; up half r], the vocabulary padded to 2 x 128 rows."""
    record = megatron_legacy(DATA / "torch" / LEGACY)
    args = argparse.Namespace(**{**vars(record["args"]), "tensor_model_parallel_size": 2,
                                 "padded_vocab_size": 256})
    for rank in range(2):
        model = {}
        for name, t in record["model"].items():
            if t is None or t.dim() == 1:
                piece = t
            elif "word_embeddings" in name or "output_layer" in name:
                piece = torch.cat([t, t.new_zeros(128, 64)]).chunk(2)[rank]
            elif "linear_proj" in name or "linear_fc2" in name:
                piece = t.chunk(2, dim=1)[rank]
            elif "linear_fc1" in name:
                gate, up = t.chunk(2)
                piece = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
            else:
                piece = t.chunk(2)[rank]
            model[name] = None if piece is None else piece.clone()
        path = out / f"iter_0000010/mp_rank_{rank:02d}/model_optim_rng.pt"
        path.parent.mkdir(parents=True)
        torch.save({**record, "model": model, "args": args}, path)
    (out / "latest_checkpointed_iteration.txt").write_text("10")
    return out


def test_local_spec_tp2_legacy_checkpoint_gives_megatrons_logits(tmp_path):
    """The local spec's column-parallel down-projections are read whole (their rows)."""
    assert convert("--import-megatron", save_local_spec_tp2(tmp_path / "m"), "--save",
                   tmp_path / "ckpt") == 0
    torch.testing.assert_close(logits(megalite_model(tmp_path / "ckpt"), REFERENCE["tokens"]),
                               REFERENCE["logits"], atol=1e-5, rtol=0)


def test_transformer_engine_fused_latent_norms_read_as_the_local_specs(tmp_path):
    """Megatron's TE spec fuses the latent norms into the up-projections
    (`linear_q_up_proj.layer_norm_weight`): the same tensors as q_layernorm / kv_layernorm."""
    assert_renamed_keys_read_the_same(DATA, tmp_path / "te", lambda k: re.sub(
        r"self_attention\.(q|kv)_layernorm\.", r"self_attention.linear_\1_up_proj.layer_norm_", k))


@pytest.mark.parametrize("name, value, message", [
    ("rope_type", "longrope", "rope_type='longrope'"),
    ("mla_down_proj_fusion", True, "MLA features megalite does not have: "
                                   "mla_down_proj_fusion=True"),
    ("experimental_attention_variant", "dsa", "experimental_attention_variant='dsa'"),
    ("position_embedding_type", "learned_absolute", "position_embedding_type="
                                                    "'learned_absolute'"),
])
def test_what_megalite_cannot_express_is_refused_by_name(tmp_path, name, value, message):
    record = megatron_legacy(DATA / "torch" / LEGACY)
    setattr(record["args"], name, value)
    path = tmp_path / "src" / LEGACY
    path.parent.mkdir(parents=True)
    torch.save(record, path)
    (tmp_path / "src/latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        reader.read_checkpoint(tmp_path / "src")


def test_the_printed_model_flags_rebuild_the_imported_model():
    """tools/convert_checkpoint.py's model flags (load_flags) for the imported MLA model:
    parsed and validated, the model a run with them loads (check_model_compatible)."""
    # The import takes every saved row as the vocabulary (the args record none).
    imported = dataclasses.replace(reader.read_checkpoint(DATA / "torch_dist").config,
                                   vocab_size=128)
    flags = tool().load_flags(imported)
    assert "--multi-latent-attention" in flags and "--qk-layernorm" in flags
    run = validate_model_args(parse_args(["--seq-length", "64", "--vocab-size", "128",
                                          "--mock-data", *flags])).model
    check_model_compatible(saving.model_fields(imported), saving.model_fields(run))
