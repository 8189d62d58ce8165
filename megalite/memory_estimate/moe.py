"""What a mixture-of-experts layer adds to the plan (model/moe.py; docs/design.md "Mixture of
experts").

Weights: the expert weights are in the model's own parameter list (weights.py builds it), so
they are counted there; `expert_weights` splits that count into routed experts (tagged
expert parallel: split over TP and EP, reduced and sharded over expert-DP = DP x CP / EP) and
the rest (reduced and sharded over DP x CP), the two groups the optimizer state lives in.

Activations: a MoE layer saves, per micro-batch, instead of the dense MLP's tensors:
- the router's fp32 input (mixed precision: a copy of the TP-gathered tokens) and three fp32
  [T, E] tensors (logits, the softmax the balancing loss keeps, its top-k map);
- under SP the TP-gathered tokens [T, h] it dispatches from (the dense MLP's gather is the
  column-parallel layer's, counted with the norm outputs);
- per dispatched row (N of them): the expert input [N, h], the fc1/activation tensors of
  the dense MLP at width F / TP, the experts' output and its fp32 copy for the combine, and
  the int64 token index, probability and order of the row;
- the shared experts as a dense MLP of their width; the residual dropout's mask.
N is the worst case of the routing, not its average: dropless, an EP rank whose experts
every token of the EP group chooses receives EP x T x min(k, E / EP) rows (with EP 1 always
T x k, however unbalanced); a capacity factor bounds it by E / EP x C per source rank, and
--moe-pad-expert-input-to-capacity makes it exactly that.
"""

from megalite.config import Config
from megalite.model.router import expert_capacity
from megalite.memory_estimate.weights import shard_numel
from megalite.tensor_parallel.params import is_expert_parallel


def dispatched_rows(config: Config, tokens: int) -> int:
    """Worst-case rows one EP rank's experts receive in one MoE layer, from `tokens` routed
    tokens per rank (see the module docstring)."""
    m, ep = config.model, config.parallel.expert_model_parallel_size
    k, local = m.moe_router_topk, m.num_experts // ep
    dropless = ep * tokens * min(k, local)
    if m.moe_expert_capacity_factor is None:
        return dropless
    capped = ep * local * expert_capacity(tokens, m.num_experts, k, m.moe_expert_capacity_factor)
    return capped if m.moe_pad_expert_input_to_capacity else min(dropless, capped)


def moe_saved_bytes(config: Config, shape) -> int:
    """One MoE layer's saved bytes in place of the dense MLP's (`shape`: activations._Shapes)."""
    m, a = config.model, shape.act_bytes
    tokens, h, tp = shape.tokens, shape.hidden, shape.tp
    rows = dispatched_rows(config, tokens)
    router = 3 * 4 * tokens * m.num_experts + (4 * tokens * h if shape.mixed else 0)
    gathered = a * tokens * h if m.sequence_parallel else 0
    ffn = m.moe_ffn_hidden_size // tp
    experts = rows * (a * h + (4 if m.swiglu else 2) * a * ffn + a * h
                      + (4 * h if shape.mixed else 0) + 8 + 4 + 8)
    shared = 0
    if m.moe_shared_expert_intermediate_size is not None:
        width = m.moe_shared_expert_intermediate_size // tp
        shared = (4 if m.swiglu else 2) * a * tokens * width
    mask = shape.mask(m.hidden_dropout) * shape.residual_tokens * h
    return router + gathered + experts + shared + mask


def expert_weights(config: Config, params) -> dict[str, int]:
    """Elements of one rank's shard of this pipeline rank's parameters, by the group their
    gradients are reduced and their optimizer state sharded over: "experts" (expert-DP) and
    "dense" (DP x CP). `params`: weights.rank_parameters (whole, TP 1, EP 1)."""
    counts = {"experts": 0, "dense": 0}
    for p in params:
        counts["experts" if is_expert_parallel(p) else "dense"] += shard_numel(config, p)
    return counts
