"""Megatron-LM mixture-of-experts checkpoints in and out (megalite/megatron_checkpoint/moe.py).

The reference is Megatron itself: tests/data/megatron_moe holds a 4-expert top-2 checkpoint
megatron.core wrote in both its formats and the logits its forward computed (README there).
The TP 2 x EP 2 legacy checkpoint is cut here by hand the way Megatron shards: each EP rank's
file holds its 2 experts numbered from 0, each expert cut over TP like a dense MLP, the
router replicated (test_megatron_checkpoint.split_like_megatron cuts the rest).
"""

import argparse
import dataclasses
import re

import pytest
import torch

from megalite.errors import CheckpointError
from megalite.megatron_checkpoint import reader
from megalite.megatron_checkpoint.load import check_compatible
from megalite.megatron_checkpoint.convert import write_megalite_checkpoint
from megalite.model.gpt import GPTModel

from tests.helpers import LLAMA_STYLE, tiny_gpt_config
from tests.test_megatron_checkpoint import (LEGACY, ROOT, assert_torch_dist_matches, convert,
                                            export_and_reimport, logits, megalite_model,
                                            megatron_legacy, split_like_megatron)

DATA = ROOT / "tests" / "data" / "megatron_moe"
REFERENCE = torch.load(DATA / "reference_logits.pt", weights_only=True)
EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")


def moe_logits(save) -> torch.Tensor:
    return logits(megalite_model(save), REFERENCE["tokens"])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_import_gives_megatrons_logits(tmp_path, fmt):
    assert convert("--import-megatron", DATA / fmt, "--save", tmp_path / "ckpt") == 0
    model = megalite_model(tmp_path / "ckpt")
    assert model.decoder.layers["1"].mlp.experts.linear_fc1.weight.shape == (4, 192, 64)
    torch.testing.assert_close(logits(model, REFERENCE["tokens"]), REFERENCE["logits"],
                               atol=1e-5, rtol=0)


def save_legacy_tp_ep(out, tp: int = 2, ep: int = 2):
    """Megatron's legacy files of the checkpoint at TP `tp`, EP `ep` (module docstring)."""
    record = megatron_legacy(DATA / "torch" / LEGACY)
    local = 4 // ep
    for t, rank in enumerate(split_like_megatron(record, tp)):
        args = argparse.Namespace(**{**vars(rank["args"]), "expert_model_parallel_size": ep})
        for e in range(ep):
            model = {}
            for name, tensor in rank["model"].items():
                expert = EXPERT.fullmatch(name)
                if ".router." in name:
                    model[name] = record["model"][name]
                elif expert is None:
                    model[name] = tensor
                elif int(expert[2]) // local == e:
                    model[f"{expert[1]}{int(expert[2]) % local}{expert[3]}"] = tensor
            path = out / f"iter_0000010/mp_rank_{t:02d}_{e:03d}/model_optim_rng.pt"
            path.parent.mkdir(parents=True)
            torch.save({**rank, "model": model, "args": args}, path)
    (out / "latest_checkpointed_iteration.txt").write_text("10")
    return out


def test_tp2_ep2_legacy_checkpoint_imports_to_the_same_model(tmp_path):
    assert convert("--import-megatron", save_legacy_tp_ep(tmp_path / "m"), "--save",
                   tmp_path / "ckpt") == 0
    assert convert("--import-megatron", DATA / "torch", "--save", tmp_path / "ref") == 0
    model, ref = megalite_model(tmp_path / "ckpt"), megalite_model(tmp_path / "ref")
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b[:a.shape[0]]), name  # b: vocabulary padded for TP 2
    torch.testing.assert_close(logits(model, REFERENCE["tokens"]), REFERENCE["logits"],
                               atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_export_writes_megatrons_files_and_reimports_losslessly(tmp_path):
    export_and_reimport(tmp_path, DATA)
    # The aux loss weight is how a run trains, which a checkpoint does not record.
    assert_torch_dist_matches(tmp_path / "megatron_torch_dist" / "iter_0000010",
                              DATA / "torch_dist" / "iter_0000010", ("moe_aux_loss_coeff",))
    legacy, megatrons = (megatron_legacy(d / LEGACY)["model"]
                         for d in (tmp_path / "megatron_torch", DATA / "torch"))
    assert list(legacy) == list(megatrons)
    for name, t in megatrons.items():
        assert (t is None and legacy[name] is None) or torch.equal(legacy[name], t), name


def _legacy_with(tmp_path, change):
    record = megatron_legacy(DATA / "torch" / LEGACY)
    change(record)
    path = tmp_path / "src" / LEGACY
    path.parent.mkdir(parents=True)
    torch.save(record, path)
    (tmp_path / "src/latest_checkpointed_iteration.txt").write_text("10")
    return tmp_path / "src"


def _set_arg(name, value):
    return lambda record: setattr(record["args"], name, value)


def _legacy_grouped(record):
    model = record["model"]
    for k in [k for k in model if ".experts." in k]:
        del model[k]
    model["decoder.layers.0.mlp.experts.weight1"] = torch.zeros(64, 768)


def _missing_expert(record):
    for k in [k for k in record["model"] if "layers.1.mlp.experts.local_experts.3." in k]:
        del record["model"][k]


@pytest.mark.parametrize("change, message", [
    (_set_arg("moe_shared_expert_gate", True), "moe_shared_expert_gate=True"),
    (_set_arg("moe_router_group_topk", 2), "--moe-router-num-groups and "
                                            "--moe-router-group-topk go together (got None and 2)"),
    (_set_arg("moe_router_load_balancing_type", "sinkhorn"), "'sinkhorn'"),
    (_legacy_grouped, "legacy GroupedMLP"),
    (_missing_expert, "holds experts [0, 1, 2] of decoder.layers.1.mlp.experts.linear_fc1"),
], ids=["shared-expert-gate", "group-topk-without-groups", "sinkhorn", "legacy-grouped-gemm", "missing-expert"])
def test_what_megalite_cannot_express_is_refused_by_name(tmp_path, change, message):
    source = _legacy_with(tmp_path, change)
    with pytest.raises(Exception, match=re.escape(message)):
        reader.read_checkpoint(source)


def test_dense_and_moe_layers_with_shared_experts_round_trip_at_tp2(tmp_path, capsys):
    """A dense layer, a MoE layer with a shared expert, exported as Megatron's legacy files at
    TP 2 and read back: the same logits, bit for bit. torch_dist, which stacks the layers,
    refuses the mix by name."""
    config = tiny_gpt_config(**LLAMA_STYLE, vocab_size=64, num_experts=4, moe_router_topk=2,
                             moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=32,
                             moe_layer_pattern=(False, True))
    model = GPTModel(config, seed=3).eval()
    write_megalite_checkpoint(tmp_path / "a", config, model.state_dict(), 7, 0, 0, None, {})
    assert convert("--load", tmp_path / "a", "--export-megatron", tmp_path / "m",
                   "--ckpt-format", "torch", "--target-tensor-parallel-size", "2") == 0
    rank1 = megatron_legacy(tmp_path / "m/iter_0000007/mp_rank_01/model_optim_rng.pt")
    assert rank1["model"]["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"] \
        .shape == (32, 8)  # [h, F / TP]
    assert convert("--import-megatron", tmp_path / "m", "--save", tmp_path / "b") == 0
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(megalite_model(tmp_path / "b"), tokens)[..., :64],
                               logits(model, tokens), atol=0, rtol=0)
    assert convert("--load", tmp_path / "a", "--export-megatron", tmp_path / "d") == 1
    assert "--ckpt-format torch" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_transformer_engine_grouped_experts_read_as_the_local_specs(tmp_path):
    """TEGroupedMLP's legacy keys (`mlp.experts.linear_fc1.weight{e}`) hold the same
    tensors as SequentialMLP's `local_experts.{e}`."""
    def te_names(record):
        record["model"] = {re.sub(r"experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight",
                                  r"experts.\2.weight\1", k): v
                           for k, v in record["model"].items() if "local_experts" not in k
                           or not k.endswith("_extra_state")}
        assert "decoder.layers.1.mlp.experts.linear_fc2.weight3" in record["model"]
        assert not [k for k in record["model"] if "local_experts" in k]
    te, local = (reader.read_checkpoint(d) for d in (_legacy_with(tmp_path, te_names),
                                                     DATA / "torch"))
    assert te.state.keys() == local.state.keys()
    for name, t in local.state.items():
        assert torch.equal(te.state[name], t), name


def test_a_run_of_another_moe_model_is_refused_before_loading():
    """pretrain_gpt.py --load on the Megatron directory compares the MoE fields too."""
    ckpt = reader.read_checkpoint(DATA / "torch_dist")
    check_compatible(ckpt, ckpt.config)
    for field, value in (("moe_ffn_hidden_size", 64), ("num_experts", None),
                         ("moe_layer_pattern", (False, True))):
        with pytest.raises(CheckpointError, match=f"{field}: checkpoint"):
            check_compatible(ckpt, dataclasses.replace(ckpt.config, **{field: value}))


def test_megatrons_moe_through_megalite_to_hf_mixtral_keeps_megatrons_logits(tmp_path):
    """tools/convert_checkpoint.py from end to end: Megatron -> megalite -> HF (Mixtral)."""
    transformers = pytest.importorskip("transformers")
    assert convert("--import-megatron", DATA / "torch_dist", "--save", tmp_path / "a") == 0
    assert convert("--load", tmp_path / "a", "--export-hf", tmp_path / "hf") == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           attn_implementation="eager")
    assert type(hf).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        got = hf.eval()(REFERENCE["tokens"]).logits
    torch.testing.assert_close(got, REFERENCE["logits"], atol=1e-5, rtol=0)


def _with_expert_bias(record):
    """Megatron's sigmoid router with expert bias: `mlp.router.expert_bias` [E] (fp32) after
    each router weight, as TopKRouter registers it."""
    setattr(record["args"], "moe_router_score_function", "sigmoid")
    setattr(record["args"], "moe_router_enable_expert_bias", True)
    model, biased = record["model"], {}
    for name, t in model.items():
        biased[name] = t
        if name.endswith("mlp.router.weight"):
            biased[name.replace("weight", "expert_bias")] = torch.randn(4)
    record["model"] = biased


def test_the_routers_expert_bias_comes_along_both_ways(tmp_path):
    source = _legacy_with(tmp_path, _with_expert_bias)
    assert convert("--import-megatron", source, "--save", tmp_path / "a") == 0
    model = megalite_model(tmp_path / "a")
    theirs = megatron_legacy(source / LEGACY)["model"]
    assert torch.equal(model.decoder.layers["1"].mlp.router.expert_bias,
                       theirs["decoder.layers.1.mlp.router.expert_bias"])
    for fmt in ("torch", "torch_dist"):
        assert convert("--load", tmp_path / "a", "--export-megatron", tmp_path / fmt,
                       "--ckpt-format", fmt) == 0
        again = reader.read_checkpoint(tmp_path / fmt).state
        assert torch.equal(again["decoder.layers.0.mlp.router.expert_bias"],
                           theirs["decoder.layers.0.mlp.router.expert_bias"]), fmt
    assert list(megatron_legacy(tmp_path / "torch" / LEGACY)["model"]) == list(theirs)
