"""The MoE layer in one process: the grouped GEMM equals the per-expert loop (forward and
gradients), the layer equals a token-by-token transcription of a mixture of experts, the
auxiliary losses reach the gradient (and not the output) with their scale, recompute counts
the expert load once, and each expert's initial values come from its own seed."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megalite.expert_parallel.grouped_gemm import grouped_linear
from megalite.model.gpt import build_model_chunks
from megalite.model.init import initial_value
from megalite.model.moe import MoELayer, set_aux_loss_scale, update_expert_bias
from megalite.model.transformer import MLP

from tests.helpers import LLAMA_STYLE, tiny_gpt_config

MOE = dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
           moe_layer_pattern=(True, True))


def _config(**overrides):
    return tiny_gpt_config(**{**LLAMA_STYLE, **MOE, **overrides})


def _layer(config, seed=0):
    torch.manual_seed(seed)
    layer = MoELayer(config, dense_mlp=MLP)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_per_expert_loop(dtype):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(13, 16, generator=g).to(dtype)
    w0 = torch.randn(4, 24, 16, generator=g).to(dtype)
    counts = torch.tensor([5, 0, 6, 2])   # an expert with no tokens too
    results = []
    for grouped in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = grouped_linear(x, w, counts, grouped)
        (y.float() * torch.arange(24.0)).sum().backward()
        results.append((y, x.grad, w.grad))
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped, loop, rtol=0, atol=0)
    assert results[0][2][1].abs().max() == 0


def leaving_empty_groups_unwritten(grouped_mm):
    """torch._grouped_mm as a kernel that writes nothing for a group without rows (B200's,
    pytorch#172439): an empty group's slab of a [groups, m, n] result is left as it was
    (NaN here)."""
    def kernel(a, b, offs=None, **kwargs):
        out = grouped_mm(a, b, offs=offs, **kwargs)
        if a.dim() == 2 and b.dim() == 2:
            out[torch.diff(offs, prepend=offs.new_zeros(1)) == 0] = float("nan")
        return out
    return kernel


@pytest.mark.parametrize("counts", [[5, 0, 6, 0], [0, 4, 0, 9], [0, 0, 0, 0]])
def test_grouped_gemm_never_reads_what_the_kernel_leaves_in_empty_groups(monkeypatch, counts):
    """Experts that receive no token (some, or all of this rank's: no rows at all) against
    the per-expert loop, with a kernel that leaves empty groups unwritten (issue 39,
    finding 10)."""
    monkeypatch.setattr(torch, "_grouped_mm", leaving_empty_groups_unwritten(torch._grouped_mm))
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(sum(counts), 16, generator=g)
    w0 = torch.randn(4, 24, 16, generator=g)
    results = []
    for grouped in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = grouped_linear(x, w, torch.tensor(counts), grouped)
        (y * torch.arange(24.0)).sum().backward()
        results.append((y, x.grad, w.grad))
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped, loop, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("counts", [[5, 0, 6, 0], [0, 0, 0, 0]])
def test_grouped_gemm_on_the_gpu_with_experts_without_tokens(counts):
    """The GPU's own kernel in bf16 (CUTLASS's on sm_90 and sm_100) against the loop, where
    some or all experts got no token: the empty experts' weight gradients exactly zero."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x0 = torch.randn(sum(counts), 16, generator=g, device="cuda").bfloat16()
    w0 = torch.randn(4, 24, 16, generator=g, device="cuda").bfloat16()
    results = []
    for grouped in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = grouped_linear(x, w, torch.tensor(counts, device="cuda"), grouped)
        (y.float() * torch.arange(24.0, device="cuda")).sum().backward()
        results.append((y, x.grad, w.grad))
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped.float(), loop.float(), rtol=2e-2, atol=2e-2)
    empty = torch.tensor(counts) == 0
    assert torch.count_nonzero(results[1][2][empty.cuda()]) == 0


def test_layer_equals_a_token_by_token_mixture():
    """out_t = sum over t's top-k experts e of p_te SwiGLU_e(x_t), plus the shared experts."""
    config = _config(moe_shared_expert_intermediate_size=32)
    layer = _layer(config).eval()
    x = torch.randn(6, 2, 32)
    out = layer(x)
    w1, w2 = layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight
    shared = layer.shared_experts(x)
    for s in range(6):
        for b in range(2):
            token = x[s, b]
            logits = layer.router.weight @ token
            top = torch.topk(logits, 2).indices
            gates = torch.softmax(logits[top], 0)
            want = shared[s, b].clone()
            for gate, e in zip(gates, top):
                gate_up = w1[e] @ token
                hidden = F.silu(gate_up[:16]) * gate_up[16:]
                want += gate * (w2[e] @ hidden)
            torch.testing.assert_close(out[s, b], want, rtol=1e-5, atol=1e-5)


def test_grouped_layer_equals_loop_layer_with_capacity_and_padding():
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(3))
    outs = []
    for grouped, pad in ((False, False), (True, False), (True, True)):
        config = _config(moe_grouped_gemm=grouped, moe_expert_capacity_factor=0.75,
                         moe_pad_expert_input_to_capacity=pad)
        layer = _layer(config)
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.square().sum().backward()
        outs.append([out, xi.grad] + [p.grad for p in layer.parameters()])
    for other in outs[1:]:  # fp32 sums in another order: round-off
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_aux_losses_reach_the_gradient_not_the_output():
    """With scale c the gradients are those of out.sum() + c x (aux + z) (Megatron's
    MoEAuxLossAutoScaler), and the output is the layer's without the losses."""
    config = _config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(4))
    layer = _layer(config)
    set_aux_loss_scale(nn.ModuleList([layer]), 0.5)
    out = layer(x)
    out.sum().backward()
    without = _layer(dataclasses.replace(config, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None))
    torch.testing.assert_close(out, without(x), rtol=0, atol=0)
    direct = _layer(config)          # the same weights; its scale 0: losses added by hand
    set_aux_loss_scale(nn.ModuleList([direct]), 0.0)
    losses = direct.router(x.reshape(16, 32), num_sequences=2).losses
    assert set(losses) == {"load_balancing_loss", "z_loss"}
    (direct(x).sum() + 0.5 * sum(losses.values())).backward()
    assert direct.router.weight.grad.abs().max() > 0
    for mine, want in zip(layer.parameters(), direct.parameters()):
        torch.testing.assert_close(mine.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_recompute_counts_the_load_once():
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     recompute_granularity="full", recompute_method="uniform")
    model = build_model_chunks(config, seed=1)
    tokens = torch.randint(0, 64, (2, 8))
    model[0](tokens, tokens).sum().backward()
    for layer in (model[0].decoder.layers["0"].mlp, model[0].decoder.layers["1"].mlp):
        load = layer.router.local_tokens_per_expert
        assert load.sum().item() == 2 * 8 * 2   # 16 tokens x top 2, counted once
    update_expert_bias(model)
    assert model[0].decoder.layers["0"].mlp.router.expert_bias.abs().sum() > 0


def test_each_expert_starts_from_its_own_seed():
    config = _config()
    model = build_model_chunks(config, seed=7)[0]
    fc1 = model.decoder.layers["1"].mlp.experts.linear_fc1.weight     # [E, 2F, h]
    fc2 = model.decoder.layers["1"].mlp.experts.linear_fc2.weight     # [E, h, F]
    for e in (0, 3):
        name = f"decoder.layers.1.mlp.experts.{e}.linear_fc1.weight"
        gate = initial_value(name.replace("linear_fc1", "linear_fc1_gate"),
                             torch.Size([16, 32]), config, 7)
        up = initial_value(name, torch.Size([16, 32]), config, 7)
        assert torch.equal(fc1[e], torch.cat([gate, up]))
        down = initial_value(f"decoder.layers.1.mlp.experts.{e}.linear_fc2.weight",
                             torch.Size([32, 16]), config, 7)
        assert torch.equal(fc2[e], down)
