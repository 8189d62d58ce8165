"""The dispatch seam between the router and the experts (docs/design.md "Mixture of experts").

The router gives each token k (expert, probability) pairs and says which pairs survive the
capacity limit. `dispatch` lays the kept pairs' tokens out by expert, so each expert's tokens
are one contiguous block of rows (the input of a grouped GEMM), stable in token order within
an expert; `combine` takes the experts' outputs in that layout back to token order, each
pair's output times its probability and summed over the token's k pairs.

Without an EP group the experts are all local and the dispatch is a sort and its inverse;
over an EP group of several ranks the tokens travel by all-to-all or all-gather
(expert_parallel/exchange.py), in the same layout: `expert_input` holds this rank's experts'
pairs from every EP rank, ordered by local expert, then source rank, then token.
"""

import torch

from megalite.expert_parallel.exchange import (AllGatherDispatch, AllToAllDispatch,
                                               sort_by_expert)
from megalite.parallel_state import group_size


class TokenDispatcher:
    """`num_experts` routed experts, split over `ep_group` (None: all local); `kind`
    "alltoall" or "allgather", how tokens travel between EP ranks. Under TP the tokens are
    already the same on every TP rank when they arrive here."""

    def __init__(self, num_experts: int, ep_group=None, kind: str = "alltoall"):
        self.num_experts, self.ep_group = num_experts, ep_group
        self._exchange = ({"alltoall": AllToAllDispatch, "allgather": AllGatherDispatch}[kind]
                          if group_size(ep_group) > 1 else None)
        self._state = None

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor,
                 keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, h], probs [T, k] fp32, indices [T, k] int64, keep [T, k] bool ->
        (expert_input [N, h], tokens_per_local_expert int64 [E_local]): the N kept pairs'
        tokens ordered by expert, in token order within an expert."""
        if self._exchange is not None:  # over the EP group (exchange.py)
            self._state = self._exchange(self.num_experts, self.ep_group)
            return self._state.dispatch(hidden, probs, indices, keep)
        pairs, counts = sort_by_expert(indices, keep, self.num_experts)
        tokens = torch.div(pairs, indices.shape[1], rounding_mode="floor")
        self._state = (tokens, probs.reshape(-1)[pairs], hidden.shape[0])
        return hidden[tokens], counts

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """expert_output [N, h] in dispatch's order -> [T, h] in token order: each pair's
        output times its probability (in fp32, as Megatron), summed over the token's pairs;
        a token whose pairs were all dropped gets zeros."""
        state, self._state = self._state, None
        if self._exchange is not None:
            return state.combine(expert_output)
        tokens, weights, num_tokens = state
        weighted = expert_output.float() * weights.unsqueeze(1)
        out = weighted.new_zeros(num_tokens, expert_output.shape[1])
        return out.index_add(0, tokens, weighted).to(expert_output.dtype)
