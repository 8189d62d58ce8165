"""The MoE router (Megatron-LM's TopKRouter), in fp32 whatever the model's dtype.

Each token's logits over the E experts pick its top k experts and their gate probabilities:
- softmax: the top k logits, then a softmax among them; with --moe-router-pre-softmax a
  softmax over all experts, then the top k (Shazeer et al. 2017; Fedus et al. 2021);
- sigmoid: sigmoid scores, the top k normalised to sum to 1 (DeepSeek-V3 §2.1.1); with the
  expert bias (auxiliary-loss-free balancing, DeepSeek-V3 §2.1.2) the bias is added to the
  scores for the choice only, never to the gate values.
With --moe-router-num-groups the top k is taken among the experts of each token's best
groups only (group_limited_topk); --moe-router-topk-scaling-factor then scales the gate
values (DeepSeek-V3's routed_scaling_factor).
A capacity factor then keeps at most C = ceil(T k / E x factor) (token, expert) pairs per
expert: the most probable ones (policy "probs") or the earliest tokens ("position").

The balancing losses are functions of the logits and the choice below, written as the papers
write them, over all T tokens of the micro-batch (`count_group`: the ranks holding the other
parts of its sequences, whose per-expert counts are summed in).
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import GPTConfig
from megalite.parallel_state import group_size
from megalite.tensor_parallel.mappings import all_reduce_


@dataclass
class Routing:
    probs: torch.Tensor
    """[T, k] fp32 gate values of each token's chosen experts."""
    indices: torch.Tensor
    """[T, k] int64 the chosen experts."""
    keep: torch.Tensor
    """[T, k] bool: the pair survives the capacity limit (all True when dropless)."""
    losses: dict[str, torch.Tensor]
    """The auxiliary losses (with their coefficients) by Megatron's logged name:
    "load_balancing_loss" / "seq_load_balancing_loss", "z_loss"."""


class TopKRouter(nn.Module):
    """weight [E, h] in the model's dtype; `expert_bias` [E] an fp32 buffer with
    --moe-router-enable-expert-bias, with `local_tokens_per_expert` the pairs each expert
    received in this step's training forwards (for the bias update after the step)."""

    def __init__(self, config: GPTConfig, count_group=None):
        super().__init__()
        self.config, self.count_group = config, count_group
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", None)
        self.register_buffer("local_tokens_per_expert", None, persistent=False)
        self.reset_buffers()

    def reset_buffers(self, device: torch.device | None = None):
        """The bias and the counts at zero (DeepSeek-V3's bias starts there), in fp32
        whatever the model's dtype, on `device` (default: torch's)."""
        if self.config.moe_router_enable_expert_bias:
            zeros = functools.partial(torch.zeros, self.config.num_experts, dtype=torch.float32,
                                      device=device)
            self.expert_bias, self.local_tokens_per_expert = zeros(), zeros()

    def forward(self, tokens: torch.Tensor, num_sequences: int) -> Routing:
        """tokens [T, h], sequence-first (token t is position t // num_sequences of sequence
        t % num_sequences, as [s, b, h] flattens)."""
        c = self.config
        with torch.autocast(tokens.device.type, enabled=False):
            logits = F.linear(tokens.float(), self.weight.float())
        groups = (None if c.moe_router_num_groups is None
                  else (c.moe_router_num_groups, c.moe_router_group_topk))
        probs, indices = topk_routing(logits, c.moe_router_topk, c.moe_router_score_function,
                                      c.moe_router_pre_softmax, self.expert_bias, groups,
                                      c.moe_router_topk_scaling_factor)
        keep = torch.ones_like(indices, dtype=torch.bool)
        if c.moe_expert_capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], c.num_experts, c.moe_router_topk,
                                       c.moe_expert_capacity_factor)
            keep = capacity_keep(probs, indices, c.num_experts, capacity,
                                 c.moe_token_drop_policy)
        if self.expert_bias is not None and counting_forward():
            with torch.no_grad():
                self.local_tokens_per_expert += torch.bincount(
                    indices[keep], minlength=c.num_experts).float()
        return Routing(probs, indices, keep, self._losses(logits, num_sequences))

    def _losses(self, logits: torch.Tensor, num_sequences: int) -> dict[str, torch.Tensor]:
        c, losses = self.config, {}
        if not torch.is_grad_enabled():
            return losses
        kind = c.moe_router_load_balancing_type
        if kind != "none" and c.moe_aux_loss_coeff > 0:
            scores = aux_loss_scores(logits, c.moe_router_score_function)
            chosen = routing_map(scores, c.moe_router_topk)
            if kind == "aux_loss":
                losses["load_balancing_loss"] = switch_load_balancing_loss(
                    scores, chosen, c.moe_router_topk, c.moe_aux_loss_coeff, self.count_group)
            else:
                losses["seq_load_balancing_loss"] = sequence_load_balancing_loss(
                    scores, chosen, num_sequences, c.moe_router_topk, c.moe_aux_loss_coeff,
                    self.count_group)
        if c.moe_z_loss_coeff:
            losses["z_loss"] = z_loss(logits, c.moe_z_loss_coeff, self.count_group)
        return losses


def counting_forward() -> bool:
    """A training forward that counts: grad enabled and not the recomputation of a
    checkpointed forward inside backward (activation recompute would count twice)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def topk_routing(logits: torch.Tensor, k: int, score_function: str, pre_softmax: bool,
                 expert_bias: torch.Tensor | None, groups: tuple[int, int] | None = None,
                 scaling_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, k] gate values, [T, k] chosen experts) from fp32 logits [T, E]; `groups`
    (num_groups, group_topk) limits each token to its best groups (group_limited_topk);
    `scaling_factor` multiplies the gate values (DeepSeek-V3's routed_scaling_factor)."""
    if score_function == "softmax":
        if pre_softmax:
            probs, indices = _topk(torch.softmax(logits, dim=-1), k, groups)
        else:
            top, indices = _topk(logits, k, groups)
            probs = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        choice = scores if expert_bias is None else scores + expert_bias
        indices = _topk(choice, k, groups)[1]
        probs = scores.gather(1, indices)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    return (probs if scaling_factor is None else probs * scaling_factor), indices


def _topk(scores: torch.Tensor, k: int, groups: tuple[int, int] | None):
    return (torch.topk(scores, k, dim=-1) if groups is None
            else group_limited_topk(scores, k, *groups))


def group_limited_topk(scores: torch.Tensor, k: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's group-limited top k (DeepSeek-V3 §2.1.2, its node-limited routing): the
    E experts in `num_groups` groups of consecutive ids, each group scored by the sum of
    its top k // group_topk scores; the top k of [T, E] `scores` among the experts of each
    token's `group_topk` best groups."""
    tokens, experts = scores.shape
    per_group = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = per_group.topk(k // group_topk, dim=-1).values.sum(dim=-1)
    chosen = torch.topk(group_scores, group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    allowed = allowed.repeat_interleave(experts // num_groups, dim=1)
    return torch.topk(scores.masked_fill(~allowed, float("-inf")), k, dim=-1)


def expert_capacity(num_tokens: int, num_experts: int, k: int, factor: float) -> int:
    """Megatron's get_capacity: the (token, expert) pairs one expert may take."""
    return math.ceil(num_tokens * k / num_experts * factor)


def capacity_keep(probs: torch.Tensor, indices: torch.Tensor, num_experts: int, capacity: int,
                  policy: str) -> torch.Tensor:
    """[T, k] bool: whether each pair is among the first `capacity` of its expert, ordered
    by gate value, highest first, ties to the earlier token ("probs"), or by token order
    ("position")."""
    experts = indices.reshape(-1)
    order = torch.arange(experts.numel(), device=experts.device)
    if policy == "probs":
        order = torch.sort(-probs.reshape(-1), stable=True).indices
    order = order[torch.sort(experts[order], stable=True).indices]   # by expert, then rank
    counts = torch.bincount(experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=order.device) - starts[experts[order]]
    keep = torch.zeros_like(experts, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep.view_as(indices)


def aux_loss_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The router's probabilities over all experts that the balancing losses see: the
    softmax, or the sigmoid scores normalised over all experts (Megatron's)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def routing_map(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, E] float 0/1: the top k experts of each token's scores (no bias, no capacity)."""
    return torch.zeros_like(scores).scatter(1, torch.topk(scores, k, dim=-1).indices, 1.0)


def switch_load_balancing_loss(scores: torch.Tensor, chosen: torch.Tensor, k: int,
                               coeff: float, count_group=None) -> torch.Tensor:
    """Switch Transformer eq. 4-6 with top k: coeff x E x sum_i f_i P_i, f_i the fraction
    of the T k pairs routed to expert i, P_i the mean probability of expert i over the T
    tokens. With `count_group` the counts are those of all its ranks' tokens and P_i sums
    only this rank's probabilities: each rank holds its part of the loss, and the parts
    sum to the loss of the whole micro-batch."""
    num_experts = scores.shape[1]
    counts = all_reduce_(chosen.sum(0), count_group)
    total = scores.shape[0] * group_size(count_group)
    return (scores.sum(0) * counts).sum() * (num_experts * coeff / (k * total * total))


def sequence_load_balancing_loss(scores: torch.Tensor, chosen: torch.Tensor,
                                 num_sequences: int, k: int, coeff: float,
                                 count_group=None) -> torch.Tensor:
    """DeepSeek-V2 eq. 12-14 / DeepSeek-V3 eq. 17-20, per sequence, averaged over the
    micro-batch's sequences: coeff x sum_i f_i P_i with f_i = E / (k S) x the sequence's
    tokens choosing i and P_i = the mean over its S tokens of i's score. Tokens are
    sequence-first ([S, B] flattened)."""
    num_experts = scores.shape[1]
    scores = scores.view(-1, num_sequences, num_experts)
    counts = all_reduce_(chosen.view_as(scores).sum(0), count_group)      # [B, E]
    length = scores.shape[0] * group_size(count_group)
    per_sequence = (scores.sum(0) * counts).sum(1) * (num_experts / (k * length * length))
    return per_sequence.mean() * coeff


def z_loss(logits: torch.Tensor, coeff: float, count_group=None) -> torch.Tensor:
    """ST-MoE eq. 5: coeff x the mean over tokens of logsumexp(logits)^2 (this rank's part of
    the sum over all `count_group` ranks' tokens)."""
    total = logits.shape[0] * group_size(count_group)
    return torch.logsumexp(logits, dim=-1).square().sum() * (coeff / total)
