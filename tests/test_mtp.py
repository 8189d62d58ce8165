"""Multi-token prediction (--mtp-num-layers; model/mtp.py, docs/design.md §33) against a
reference written out plainly here: each depth k embeds the token k ahead, normalizes it and
the previous depth's hidden state, concatenates [embedding; hidden], projects, runs the
layer, normalizes and reads the shared output layer, and its cross-entropy against the token
k + 1 ahead is averaged over the positions that have one. Depth k sees only the first s - k
positions in the reference (causal attention: the later ones cannot change them), so the
reference needs no rolled or padded tensors at all."""

import copy

import pytest
import torch
import torch.nn.functional as F

from megalite.data.sampler import add_mtp_targets
from megalite.errors import ConfigError
from megalite.hf_convert import model_style
from megalite.layout_check import build_run
from megalite.model.gpt import GPTModel
from megalite.model.mtp import set_mtp_loss_weights, take_mtp_loss_sums
from megalite.arguments import parse_args
from megalite.training_log import log_line, num_floating_point_operations, parse_log_line
from megalite.train_step import loss_token_counts
from megalite.validation import validate_args

from tests.helpers import LLAMA_STYLE, flags_with, tiny_gpt_config

SCALING = 0.3  # not Megatron's default 0.1, so that a default in place of the flag shows


def plain_mtp_means(model: GPTModel, sequence: torch.Tensor, loss_mask: torch.Tensor):
    """(lm loss, [mtp_k loss for each depth k]) of `model` on `sequence` [b, s + 1] (tokens
    and the token after), the loss mask over the s label positions; token-weighted means."""
    c = model.config
    tokens, labels = sequence[:, :-1], sequence[:, 1:]
    s = tokens.shape[1]
    table = model.rope_table(tokens.device)
    embedding = model.embedding.word_embeddings.weight
    output = model.output_layer.weight

    def norm(x, module):
        return F.rms_norm(x, (c.hidden_size,), module.weight, c.norm_epsilon)

    def ce(h, targets):  # h [L, b, h] -> per-token losses [b, L]
        return F.cross_entropy((h @ output.t()).transpose(0, 1).flatten(0, 1),
                               targets.flatten(), reduction="none").view(targets.shape)

    hidden = model.decoder(embedding[tokens].transpose(0, 1), table)  # after the final norm
    lm = (ce(hidden, labels) * loss_mask).sum() / loss_mask.sum()
    means = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        n = s - k  # positions with a token k + 1 ahead
        ahead = embedding[sequence[:, k:k + n]].transpose(0, 1)  # the token k ahead
        x = torch.cat([norm(ahead, layer.enorm), norm(hidden[:n], layer.hnorm)], dim=-1)
        x = layer.transformer_layer(x @ layer.eh_proj.weight.t(), table[:n])
        hidden = norm(x, layer.final_layernorm)
        mask = loss_mask[:, k:k + n]  # the mask of label position i + k: token i + k + 1
        means.append((ce(hidden, sequence[:, k + 1:k + 1 + n]) * mask).sum() / mask.sum())
    return lm, means


def batch_of(sequence, loss_mask, depths):
    return add_mtp_targets({"tokens": sequence[:, :-1], "labels": sequence[:, 1:],
                            "loss_mask": loss_mask}, depths)


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_loss_and_gradients_equal_the_plain_reference(depths):
    config = tiny_gpt_config(**LLAMA_STYLE, mtp_num_layers=depths,
                             mtp_loss_scaling_factor=SCALING)
    model = GPTModel(config, seed=5)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, 64, (3, config.seq_length + 1), generator=g)
    loss_mask = (torch.rand(3, config.seq_length, generator=g) > 0.25).float()
    mb = batch_of(sequence, loss_mask, depths)

    counts = loss_token_counts([mb], depths)
    set_mtp_loss_weights([model], SCALING / depths / counts[1:])
    losses = model(mb["tokens"], mb["labels"],
                   mtp_targets=(mb["mtp_labels"], mb["mtp_loss_mask"]))
    ((losses * loss_mask).sum() / counts[0]).backward()
    logged = take_mtp_loss_sums([model], depths, torch.device("cpu")) / counts[1:]

    lm, means = plain_mtp_means(reference, sequence, loss_mask)
    (lm + SCALING / depths * sum(means)).backward()
    # the returned losses are the lm loss's alone; the MTP term is in the gradient only
    torch.testing.assert_close((losses * loss_mask).sum() / counts[0], lm)
    torch.testing.assert_close(logged, torch.stack(means).detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
    assert model.mtp.layers[depths - 1].eh_proj.weight.grad.abs().sum() > 0


def test_a_training_step_reports_the_mtp_losses_and_not_in_the_lm_loss():
    """Through the loader (its targets), the step's normalisation and the log line."""
    flags = flags_with("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                       "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                       "--attention-dropout", "0", "--hidden-dropout", "0", "--num-workers", "0",
                       "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", str(SCALING),
                       vocab_size=64, hidden_size=32, num_layers=2, seq_length=8,
                       micro_batch_size=2, global_batch_size=4)
    config, _, model, _, runner, batches = build_run(flags, 1, 0, torch.device("cpu"))
    microbatches = [next(batches) for _ in range(config.training.num_microbatches)]
    reference = copy.deepcopy(model[0])
    result = runner.train_step(microbatches)

    sequence = torch.cat([torch.cat([mb["tokens"], mb["labels"][:, -1:]], dim=1)
                          for mb in microbatches])
    loss_mask = torch.cat([mb["loss_mask"] for mb in microbatches])
    lm, means = plain_mtp_means(reference, sequence, loss_mask)
    assert result.loss == pytest.approx(lm.item(), rel=1e-5)
    assert result.mtp_losses == pytest.approx([m.item() for m in means], rel=1e-5)
    line = log_line(iteration=1, train_iters=1, lm_loss=result.loss,
                    mtp_losses={"1": result.mtp_losses[0], "2": result.mtp_losses[1]},
                    moe_losses={"load_balancing_loss": 0.5})
    assert f"| mtp_1 loss: {result.mtp_losses[0]:.6E} | mtp_2 loss:" in line
    parsed = parse_log_line(line)
    assert parsed["mtp_losses"] == pytest.approx({"1": result.mtp_losses[0],
                                                  "2": result.mtp_losses[1]}, rel=1e-6)
    assert parsed["moe_losses"] == {"load_balancing_loss": 0.5}


def test_the_targets_are_shifted_on_the_whole_sample():
    labels = torch.tensor([[1, 2, 3, 4]])
    batch = add_mtp_targets({"labels": labels, "loss_mask": torch.ones(1, 4)}, 2)
    assert batch["mtp_labels"][0].t().tolist() == [[2, 3, 4, 0], [3, 4, 0, 0]]
    assert batch["mtp_loss_mask"][0].t().tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]


@pytest.mark.parametrize("extra, message", [
    ([], "needs --position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--reset-attention-mask"], "--reset-attention-mask"),
    (["--position-embedding-type", "rope", "--fp8-format", "e4m3"], "--fp8-format"),
    (["--position-embedding-type", "rope", "--mtp-loss-scaling-factor", "-1"], ">= 0"),
    (["--position-embedding-type", "rope", "--mtp-num-layers", "0"], "must be >= 1"),
    (["--position-embedding-type", "rope", "--mtp-num-layers", "32"], "no position to predict"),
])
def test_what_mtp_cannot_run_with_is_refused_by_name(extra, message):
    with pytest.raises(ConfigError, match=message):
        validate_args(parse_args(flags_with("--mtp-num-layers", "1", *extra)))


@pytest.mark.parametrize("moe", [False, True])
def test_the_flops_count_the_depths_as_megatron_does(moe):
    """Megatron's num_floating_point_operations: each depth one more layer of the last
    layer's kind, one more logit GEMM, and its norms and eh_proj, 6 B s (3h + 2h^2)."""
    experts = dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                   moe_layer_pattern=(False, True)) if moe else {}
    base = tiny_gpt_config(**LLAMA_STYLE, **experts)
    B, s, h, V = 3, base.seq_length, base.hidden_size, base.padded_vocab_size
    swiglu_mlp = 3 * 2 * 3 * h * (16 * 2 if moe else base.ffn_hidden_size)  # per token
    attention = 3 * 2 * (2 * h * h + 2 * h * base.kv_projection_size + s * h)  # per token
    per_depth = B * s * (attention + swiglu_mlp + 6 * h * V + 6 * (3 * h + 2 * h * h))
    for depths in (1, 2):
        mtp = tiny_gpt_config(**LLAMA_STYLE, **experts, mtp_num_layers=depths)
        assert num_floating_point_operations(mtp, B) == pytest.approx(
            num_floating_point_operations(base, B) + depths * per_depth, rel=1e-12)


def test_hf_conversion_refuses_the_mtp_weights_by_name():
    """(Megatron's checkpoints carry them: tests/test_megatron_mtp.py.)"""
    config = tiny_gpt_config(**LLAMA_STYLE, mtp_num_layers=1)
    with pytest.raises(ConfigError, match="mtp_num_layers=1"):
        model_style(config)
