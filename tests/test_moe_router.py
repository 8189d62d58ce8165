"""The MoE router against direct transcriptions of the published formulas on fixed inputs:
top-k gating (softmax, pre-softmax, DeepSeek-V3's normalised sigmoid with its selection-only
bias), Switch Transformer's load-balancing loss (eq. 4-6, with Megatron's top-k count),
DeepSeek-V3's sequence-wise loss (eq. 17-20), ST-MoE's z-loss (eq. 5), DeepSeek-V3's bias
update (§2.1.2), and the capacity limit's drop policies. The transcriptions loop over tokens
and experts in plain Python, as the papers write them."""

import math

import pytest
import torch
from torch import nn

from megalite.model.moe import update_expert_bias
from megalite.model.router import (aux_loss_scores, capacity_keep, expert_capacity,
                                   routing_map, sequence_load_balancing_loss,
                                   switch_load_balancing_loss, topk_routing, z_loss)

T, E = 12, 4
LOGITS = torch.randn(T, E, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _softmax(row):
    exps = [math.exp(v) for v in row]
    return [e / sum(exps) for e in exps]


def _sigmoid(row):
    return [1 / (1 + math.exp(-v)) for v in row]


def _top(row, k):
    """Indices of the k largest values, largest first."""
    return sorted(range(len(row)), key=lambda i: -row[i])[:k]


LOGITS_8 = torch.randn(T, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def test_group_limited_sigmoid_routing_with_scaling():
    """DeepSeek-V3 §2.1.2 with Megatron's group score: 8 experts in 4 groups of 2, each token
    keeps its best 2 groups (a group's score: the sum of its top k / 2 = 2 biased scores),
    then its top 4 experts among them; the gate values, normalised, times 2.5."""
    bias = torch.tensor([0.05, -0.1, 0.2, 0.0, 0.3, -0.05, 0.1, 0.15], dtype=torch.float64)
    probs, indices = topk_routing(LOGITS_8, 4, "sigmoid", False, bias, groups=(4, 2),
                                  scaling_factor=2.5)
    plain = topk_routing(LOGITS_8, 4, "sigmoid", False, bias)[1]
    for t, row in enumerate(LOGITS_8.tolist()):
        s = _sigmoid(row)
        choice = [s[i] + bias[i].item() for i in range(8)]
        group_score = [sum(sorted(choice[2 * g:2 * g + 2], reverse=True)[:2]) for g in range(4)]
        allowed = [i for g in _top(group_score, 2) for i in (2 * g, 2 * g + 1)]
        chosen = sorted(allowed, key=lambda i: -choice[i])[:4]
        gates = [2.5 * s[i] / sum(s[j] for j in chosen) for i in chosen]
        assert indices[t].tolist() == chosen
        assert probs[t].tolist() == pytest.approx(gates, rel=1e-12)
    # The groups bind: some token's plain top 4 reaches outside its 2 groups.
    assert not torch.equal(indices, plain)


def test_group_limited_softmax_routing():
    """Megatron applies the groups to softmax routing alike: 8 experts, 2 groups of 4, one
    kept (scored by the sum of its top 2 logits), the top 2 logits in it, softmaxed."""
    probs, indices = topk_routing(LOGITS_8, 2, "softmax", False, None, groups=(2, 1))
    for t, row in enumerate(LOGITS_8.tolist()):
        group_score = [sum(sorted(row[4 * g:4 * g + 4], reverse=True)[:2]) for g in range(2)]
        g = _top(group_score, 1)[0]
        chosen = sorted(range(4 * g, 4 * g + 4), key=lambda i: -row[i])[:2]
        assert indices[t].tolist() == chosen
        assert probs[t].tolist() == pytest.approx(_softmax([row[i] for i in chosen]), rel=1e-12)


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_softmax_gating(pre_softmax):
    probs, indices = topk_routing(LOGITS, 2, "softmax", pre_softmax, None)
    for t, row in enumerate(LOGITS.tolist()):
        chosen = _top(row, 2)
        if pre_softmax:  # softmax over all experts, then the top 2 as they are
            gates = [_softmax(row)[i] for i in chosen]
        else:  # the top 2 logits, then a softmax among them
            gates = _softmax([row[i] for i in chosen])
        assert indices[t].tolist() == chosen
        assert probs[t].tolist() == pytest.approx(gates, rel=1e-12)


def test_sigmoid_gating_with_selection_only_bias():
    bias = torch.tensor([0.0, 0.3, -0.2, 0.1], dtype=torch.float64)
    probs, indices = topk_routing(LOGITS, 2, "sigmoid", False, bias)
    for t, row in enumerate(LOGITS.tolist()):
        s = _sigmoid(row)
        chosen = _top([s[i] + bias[i].item() for i in range(E)], 2)  # DeepSeek-V3 eq. 16
        gates = [s[i] / sum(s[j] for j in chosen) for i in chosen]   # eq. 13: g from s only
        assert indices[t].tolist() == chosen
        assert probs[t].tolist() == pytest.approx(gates, rel=1e-12)


@pytest.mark.parametrize("k", [1, 2])
def test_switch_load_balancing_loss(k):
    """Switch Transformer eq. 4-6: alpha N sum_i f_i P_i; f_i the fraction of tokens sent to
    expert i (of the T k choices with top k, as Megatron counts), P_i the mean router
    probability of expert i."""
    alpha = 0.01
    p = [_softmax(row) for row in LOGITS.tolist()]
    chosen = [_top(row, k) for row in p]
    f = [sum(i in c for c in chosen) / (T * k) for i in range(E)]
    P = [sum(p[t][i] for t in range(T)) / T for i in range(E)]
    expected = alpha * E * sum(f[i] * P[i] for i in range(E))
    scores = aux_loss_scores(LOGITS, "softmax")
    loss = switch_load_balancing_loss(scores, routing_map(scores, k), k, alpha)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_sequence_load_balancing_loss():
    """DeepSeek-V3 eq. 17-20 per sequence (normalised sigmoid scores s'), averaged over the
    micro-batch's sequences; tokens are sequence-first: token t is position t // B of
    sequence t % B."""
    alpha, k, B = 0.001, 2, 3
    S = T // B
    per_sequence = []
    for b in range(B):
        rows = [LOGITS[pos * B + b].tolist() for pos in range(S)]
        s = [_sigmoid(row) for row in rows]
        s_norm = [[v / sum(row) for v in row] for row in s]
        chosen = [_top(row, k) for row in s_norm]
        f = [E / (k * S) * sum(i in c for c in chosen) for i in range(E)]
        P = [sum(s_norm[pos][i] for pos in range(S)) / S for i in range(E)]
        per_sequence.append(alpha * sum(f[i] * P[i] for i in range(E)))
    scores = aux_loss_scores(LOGITS, "sigmoid")
    loss = sequence_load_balancing_loss(scores, routing_map(scores, k), B, k, alpha)
    assert loss.item() == pytest.approx(sum(per_sequence) / B, rel=1e-12)


def test_z_loss():
    """ST-MoE eq. 5: (1/B) sum_i (log sum_j exp x_ij)^2, times its coefficient."""
    expected = 1e-3 * sum(math.log(sum(math.exp(v) for v in row)) ** 2
                          for row in LOGITS.tolist()) / T
    assert z_loss(LOGITS, 1e-3).item() == pytest.approx(expected, rel=1e-12)


def test_expert_bias_update():
    """DeepSeek-V3 §2.1.2: an overloaded expert's bias falls by gamma, an underloaded one's
    rises by gamma, one at the mean load stays; the counts restart."""
    from megalite.model.moe import MoELayer  # a stand-in chunk holding one router
    layer = MoELayer.__new__(MoELayer)
    nn.Module.__init__(layer)
    layer.config = type("C", (), {"moe_router_bias_update_rate": 0.25})()
    layer.router = nn.Module()
    layer.router.register_buffer("expert_bias", torch.tensor([0.0, 1.0, -1.0, 0.5]))
    layer.router.register_buffer("local_tokens_per_expert", torch.tensor([9.0, 1.0, 5.0, 5.0]))
    update_expert_bias(nn.ModuleList([layer]))
    assert layer.router.expert_bias.tolist() == [-0.25, 1.25, -1.0, 0.5]
    assert layer.router.local_tokens_per_expert.tolist() == [0.0] * 4


def _kept_by_loop(probs, indices, capacity, policy):
    """Per expert, its pairs in the policy's order; the first `capacity` stay."""
    keep = [[False] * indices.shape[1] for _ in range(indices.shape[0])]
    for e in range(E):
        pairs = [(t, j) for t in range(indices.shape[0]) for j in range(indices.shape[1])
                 if indices[t, j] == e]
        if policy == "probs":
            pairs.sort(key=lambda tj: -probs[tj].item())  # stable: ties to the earlier token
        for t, j in pairs[:capacity]:
            keep[t][j] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_what_the_policy_says(policy):
    probs, indices = topk_routing(LOGITS, 2, "softmax", False, None)
    capacity = expert_capacity(T, E, 2, 0.5)
    assert capacity == 3  # ceil(12 x 2 / 4 x 0.5)
    keep = capacity_keep(probs, indices, E, capacity, policy)
    assert keep.tolist() == _kept_by_loop(probs, indices, capacity, policy)
    counts = torch.bincount(indices[keep], minlength=E)
    assert counts.max() <= capacity and not keep.all()


def test_capacity_fixed_case():
    """Expert 0 is chosen by all four tokens with capacity 2: "position" keeps tokens 0 and
    1, "probs" the two most probable (tokens 3 and 1)."""
    indices = torch.tensor([[0], [0], [0], [0]])
    probs = torch.tensor([[0.1], [0.5], [0.2], [0.9]])
    assert capacity_keep(probs, indices, 1, 2, "position").view(-1).tolist() == \
        [True, True, False, False]
    assert capacity_keep(probs, indices, 1, 2, "probs").view(-1).tolist() == \
        [False, True, False, True]
