"""Multi-token prediction and DeepSeek's routing flags in Megatron-LM checkpoints, both
directions, both formats (megalite/megatron_checkpoint; docs/design.md §33).

The reference is Megatron itself: tests/data/megatron_mtp holds a dense GPT with one MTP depth
megatron.core wrote in both its formats, its logits and the MTP loss it logged (README there).
The expected keys of the layouts Megatron did not write here (TP 2 x PP 2, MoE and MLA in the
depth) are written out from Megatron's names (multi_token_prediction.py: MultiTokenPredictionLayer
registers enorm, hnorm, eh_proj, `mtp_model_layer`, which its sharded_state_dict names
`transformer_layer`, and final_layernorm; GPTModel builds its embedding on the last stage too
when that stage runs the MTP), not from megalite's code.
"""

import pytest
import torch

from megalite.checkpointing.saving import model_fields
from megalite.megatron_checkpoint import reader
from megalite.megatron_checkpoint.convert import write_megalite_checkpoint
from megalite.megatron_checkpoint.optimizer_state import adam_state
from megalite.megatron_checkpoint.writer import write_checkpoint
from megalite.model.gpt import GPTModel
from megalite.model.mtp import set_mtp_loss_weights, take_mtp_loss_sums
from megalite.data.sampler import add_mtp_targets

from tests.helpers import LLAMA_STYLE, tiny_gpt_config
from tests.test_megatron_checkpoint import (LEGACY, ROOT, _dcp_entries,
                                            assert_renamed_keys_read_the_same,
                                            assert_torch_dist_matches, convert, megalite_model,
                                            megatron_legacy)

DATA = ROOT / "tests" / "data" / "megatron_mtp"
REFERENCE = torch.load(DATA / "reference_logits.pt", weights_only=True)

MLA = dict(LLAMA_STYLE, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16,
           qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, kv_channels=24,
           qk_layernorm=True)
# Every layer a MoE layer (torch_dist stacks them); 4 experts in 2 groups, 1 group chosen.
GROUPED_MOE = dict(num_experts=4, moe_layer_pattern=(True, True), moe_router_topk=2,
                   moe_ffn_hidden_size=16,
                   moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid",
                   moe_router_enable_expert_bias=True, moe_router_num_groups=2,
                   moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5)
CASES = {"dense": dict(LLAMA_STYLE, mtp_num_layers=1, mtp_loss_scaling_factor=0.3),
         "tied": dict(LLAMA_STYLE, untie_embeddings_and_output_weights=False, mtp_num_layers=1),
         "mla-moe-groups": dict(MLA, **GROUPED_MOE, mtp_num_layers=1)}
LAYOUTS = [("torch", "2", "2"), ("torch", "1", "1"), ("torch_dist", "1", "1")]

# Megatron's legacy file of the last stage (TP rank 0 of 2, PP rank 1 of 2) of the dense case:
# key and shard shape, in its state-dict order (hidden 32, 4 heads of 8, FFN 64, vocab 64): the
# keys Megatron-LM wrote at TP 1 x PP 2, tied or not (tests/data/megatron_mtp/README.md).
LAYER = [("input_layernorm.weight", (32,)), ("self_attention.linear_proj.weight", (32, 16)),
         ("self_attention.linear_proj._extra_state", None),
         ("self_attention.linear_qkv.weight", (48, 32)),
         ("self_attention.linear_qkv._extra_state", None), ("pre_mlp_layernorm.weight", (32,)),
         ("mlp.linear_fc1.weight", (64, 32)), ("mlp.linear_fc1._extra_state", None),
         ("mlp.linear_fc2.weight", (32, 32)), ("mlp.linear_fc2._extra_state", None)]
LAST_STAGE = ([("embedding.word_embeddings.weight", (32, 32))]
              + [(f"decoder.layers.0.{k}", s) for k, s in LAYER]
              + [("decoder.final_layernorm.weight", (32,)), ("mtp.layers.0.enorm.weight", (32,)),
                 ("mtp.layers.0.hnorm.weight", (32,)), ("mtp.layers.0.eh_proj.weight", (16, 64)),
                 ("mtp.layers.0.eh_proj._extra_state", None)]
              + [(f"mtp.layers.0.mtp_model_layer.{k}", s) for k, s in LAYER]
              + [("mtp.layers.0.final_layernorm.weight", (32,)), ("output_layer.weight", (32, 32)),
                 ("output_layer._extra_state", None)])
# torch_dist's MTP entries of the dense case: whole tensors, not stacked (no layer offset),
# norms fused as a decoder layer's, extra states as unsharded objects.
MTP_TORCH_DIST = {
    "mtp.layers.0.enorm.weight": (32,), "mtp.layers.0.hnorm.weight": (32,),
    "mtp.layers.0.eh_proj.weight": (32, 64), "mtp.layers.0.final_layernorm.weight": (32,),
    "mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight": (32,),
    "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight": (96, 32),
    "mtp.layers.0.transformer_layer.self_attention.linear_proj.weight": (32, 32),
    "mtp.layers.0.transformer_layer.mlp.linear_fc1.layer_norm_weight": (32,),
    "mtp.layers.0.transformer_layer.mlp.linear_fc1.weight": (128, 32),
    "mtp.layers.0.transformer_layer.mlp.linear_fc2.weight": (32, 64),
    **{f"mtp.layers.0.{m}._extra_state/shard_0_1": None for m in (
        "eh_proj", "transformer_layer.self_attention.linear_proj",
        "transformer_layer.self_attention.linear_qkv", "transformer_layer.mlp.linear_fc1",
        "transformer_layer.mlp.linear_fc2")}}


def mtp_losses(model: GPTModel, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(logits, per-token lm losses, each depth's token-mean MTP loss) of `model` on `tokens`
    [b, s + 1] (its first s the input)."""
    depths = model.config.mtp_depths
    labels = tokens[:, 1:]
    batch = add_mtp_targets({"labels": labels, "loss_mask": torch.ones(labels.shape)}, depths)
    set_mtp_loss_weights([model], torch.ones(depths))
    model.train()
    with torch.no_grad():
        lm = model(tokens[:, :-1], labels, mtp_targets=(batch["mtp_labels"],
                                                        batch["mtp_loss_mask"]))
        sums = take_mtp_loss_sums([model], depths, torch.device("cpu"))
        logits = model.eval()(tokens[:, :-1])
    return logits, lm, sums / batch["mtp_loss_mask"].sum(dim=(0, 1))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_import_gives_megatrons_logits_and_mtp_loss(tmp_path, fmt):
    assert convert("--import-megatron", DATA / fmt, "--save", tmp_path / "ckpt") == 0
    model = megalite_model(tmp_path / "ckpt")
    assert model.config.mtp_num_layers == 1
    logits, lm, mtp = mtp_losses(model, REFERENCE["sequence"])
    torch.testing.assert_close(logits, REFERENCE["logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(lm, REFERENCE["lm_losses"], atol=1e-5, rtol=0)
    torch.testing.assert_close(mtp, REFERENCE["mtp_loss"], atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_export_writes_megatrons_files(tmp_path):
    """Megatron's checkpoint imported and exported in both formats: Megatron's keys (in order
    in the legacy file), tensors and args; imported again, the same model bit for bit."""
    assert convert("--import-megatron", DATA / "torch_dist", "--save", tmp_path / "a") == 0
    first = megalite_model(tmp_path / "a")
    for fmt in ("torch", "torch_dist"):
        out = tmp_path / f"megatron_{fmt}"  # Megatron's 64 rows: divisible by 64, not 128
        assert convert("--load", tmp_path / "a", "--export-megatron", out, "--ckpt-format", fmt,
                       "--make-vocab-size-divisible-by", "64") == 0
        assert convert("--import-megatron", out, "--save", tmp_path / f"b_{fmt}") == 0
        again = megalite_model(tmp_path / f"b_{fmt}")
        for (name, x), (_, y) in zip(first.state_dict().items(), again.state_dict().items()):
            assert torch.equal(x, y), (fmt, name)
    assert_torch_dist_matches(tmp_path / "megatron_torch_dist" / "iter_0000010",
                              DATA / "torch_dist" / "iter_0000010")
    ours, megatrons = (megatron_legacy(d / LEGACY) for d in (tmp_path / "megatron_torch",
                                                             DATA / "torch"))
    assert list(ours["model"]) == list(megatrons["model"])
    for name, t in megatrons["model"].items():
        assert (t is None and ours["model"][name] is None) or \
            torch.equal(ours["model"][name], t), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
@pytest.mark.parametrize("case", CASES)
def test_mtp_round_trips_through_megatrons_files(tmp_path, case):
    """Exported at TP 2 x PP 2 and TP 1 (torch), and torch_dist, imported back: the same
    tensors bit for bit, the same logits and MTP losses; the routing flags in the args."""
    config = tiny_gpt_config(**CASES[case], vocab_size=64)
    model = GPTModel(config, seed=4)
    write_megalite_checkpoint(tmp_path / "a", config, model.state_dict(), 7, 0, 0, None, {})
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    expected = mtp_losses(model, tokens)
    for fmt, tp, pp in LAYOUTS:
        out = tmp_path / f"m_{fmt}_{tp}_{pp}"
        assert convert("--load", tmp_path / "a", "--export-megatron", out, "--ckpt-format", fmt,
                       "--target-tensor-parallel-size", tp, "--target-pipeline-parallel-size",
                       pp, "--make-vocab-size-divisible-by", "32") == 0
        args = reader.read_checkpoint(out).args
        assert args.mtp_num_layers == 1
        if config.num_experts:
            assert (args.moe_router_num_groups, args.moe_router_group_topk,
                    args.moe_router_topk_scaling_factor) == (2, 1, 2.5)
        assert convert("--import-megatron", out, "--save", tmp_path / f"b_{out.name}") == 0
        again = megalite_model(tmp_path / f"b_{out.name}")
        assert model_fields(again.config) == model_fields(config), out.name
        for (name, x), (_, y) in zip(model.state_dict().items(), again.state_dict().items()):
            assert torch.equal(x, y), (out.name, name)
        for got, want in zip(mtp_losses(again, tokens), expected):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_the_files_hold_megatrons_mtp_keys(tmp_path):
    """The dense case's last-stage legacy file at TP 2 x PP 2 and its torch_dist entries."""
    config = tiny_gpt_config(**CASES["dense"], vocab_size=64)
    model = GPTModel(config, seed=4)
    for fmt, tp in (("torch", 2), ("torch_dist", 1)):
        write_checkpoint(tmp_path / fmt, config, model.state_dict(), 7, fmt, tp, tp, 32)
        # --mtp-loss-scaling-factor is a training flag megalite's checkpoints do not record
        # (tools/convert_checkpoint.py exports Megatron's default); the model's is written.
        ckpt = reader.read_checkpoint(tmp_path / fmt)
        assert ckpt.args.mtp_loss_scaling_factor == ckpt.config.mtp_loss_scaling_factor == 0.3
    last = megatron_legacy(tmp_path / "torch/iter_0000007/mp_rank_00_001/model_optim_rng.pt")
    assert [(k, None if t is None else tuple(t.shape)) for k, t in last["model"].items()] == \
        LAST_STAGE
    # The last stage's word embeddings are the model's (TP rank 0's rows).
    assert torch.equal(last["model"]["embedding.word_embeddings.weight"],
                       model.embedding.word_embeddings.weight[:32])
    entries = _dcp_entries(tmp_path / "torch_dist/iter_0000007")
    mtp = {k: tuple(v.shape) if torch.is_tensor(v) else None for k, v in entries.items()
           if k.startswith("mtp.")}
    assert mtp == MTP_TORCH_DIST
    assert torch.equal(entries["mtp.layers.0.eh_proj.weight"],
                       model.mtp.layers[0].eh_proj.weight)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_an_mtp_moe_mla_layer_has_megatrons_torch_dist_keys(tmp_path):
    """The MTP's MoE layer: experts [E, ...] without a layer dimension, their extra states
    sharded by expert only; MLA's latent norms under their own names (local spec)."""
    config = tiny_gpt_config(**CASES["mla-moe-groups"], vocab_size=64)
    write_checkpoint(tmp_path / "m", config, GPTModel(config, seed=4).state_dict(), 7,
                     "torch_dist", divisible_by=32)
    entries = _dcp_entries(tmp_path / "m/iter_0000007")
    layer = "mtp.layers.0.transformer_layer."
    shapes = {k[len(layer):]: tuple(v.shape) for k, v in entries.items()
              if k.startswith(layer) and torch.is_tensor(v)}
    assert shapes["mlp.experts.experts.linear_fc1.weight"] == (4, 32, 32)  # [E, 2F, h]
    assert shapes["mlp.experts.experts.linear_fc2.weight"] == (4, 32, 16)
    assert shapes["mlp.router.weight"] == (4, 32) and shapes["mlp.router.expert_bias"] == (4,)
    assert shapes["mlp.shared_experts.linear_fc1.weight"] == (64, 32)
    assert shapes["self_attention.kv_layernorm.weight"] == (16,)
    assert shapes["self_attention.linear_q_down_proj.weight"] == (24, 32)
    assert shapes["input_layernorm.weight"] == (32,)
    assert shapes["pre_mlp_layernorm.weight"] == (32,)
    objects = {k[len(layer):] for k, v in entries.items() if k.startswith(layer)
               and not torch.is_tensor(v)}
    assert {f"mlp.experts.experts.linear_fc{k}._extra_state/shard_{e}_4" for e in range(4)
            for k in (1, 2)} | {"mlp.shared_experts.linear_fc1._extra_state/shard_0_1",
                                "self_attention.linear_q_up_proj._extra_state/shard_0_1"} \
        <= objects


def test_older_megatrons_legacy_name_transformer_layer_reads_the_same(tmp_path):
    """Before Megatron named the module `mtp_model_layer`, its legacy files said
    `transformer_layer`: the same tensors."""
    assert_renamed_keys_read_the_same(DATA, tmp_path / "old", lambda k: k.replace(
        ".mtp_model_layer.", ".transformer_layer."))


def _add_adam_state(path, shift: float) -> None:
    """Adam's state in a legacy file as Megatron's FP32Optimizer saves it (param groups:
    decayed, then 1-D), moments made from each saved tensor plus `shift`."""
    record = megatron_legacy(path)
    params = [(n, t) for n, t in record["model"].items() if t is not None]
    order = [p for p in params if p[1].dim() > 1] + [p for p in params if p[1].dim() == 1]
    decayed = sum(t.dim() > 1 for _, t in params)
    state = {i: {"step": torch.tensor(2.0), "exp_avg": t + shift, "exp_avg_sq": t * t}
             for i, (_, t) in enumerate(order)}
    groups = [{"params": list(range(decayed))}, {"params": list(range(decayed, len(order)))}]
    torch.save({**record, "optimizer": {"state": state, "param_groups": groups}}, path)


def test_adam_state_at_pp2_takes_the_first_stages_embedding(tmp_path):
    """The last stage's word-embedding copy has Adam state too (Megatron keeps the two equal);
    the import takes the first stage's, once, and the MTP's own."""
    config = tiny_gpt_config(**CASES["dense"], vocab_size=64)
    model = GPTModel(config, seed=4)
    write_checkpoint(tmp_path / "m", config, model.state_dict(), 7, "torch", 1, 2, 32)
    for stage in range(2):
        _add_adam_state(tmp_path / f"m/iter_0000007/mp_rank_00_{stage:03d}/model_optim_rng.pt",
                        shift=1.0 + stage)
    adam, why = adam_state(reader.read_checkpoint(tmp_path / "m"))
    assert adam is not None, why
    embedding = model.embedding.word_embeddings.weight
    assert torch.equal(adam.tensors["embedding.word_embeddings.weight"]["exp_avg"], embedding + 1)
    eh_proj = model.mtp.layers[0].eh_proj.weight
    assert torch.equal(adam.tensors["mtp.layers.0.eh_proj.weight"]["exp_avg"], eh_proj + 2)
