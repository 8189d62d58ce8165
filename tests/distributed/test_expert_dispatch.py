"""The expert-parallel token exchange (megalite/expert_parallel/exchange.py) against one
process: random tokens routed to random experts (some pairs dropped), each expert a linear
map; the dispatched rows, the combined output and the gradients of the tokens, the
probabilities and the experts equal the closed form computed from every rank's tokens.
One launch of 4 ranks runs EP 4 and EP 2 (two groups), all-to-all and all-gather."""

import pytest
import torch
import torch.distributed as dist

from megalite.expert_parallel.exchange import AllGatherDispatch, AllToAllDispatch
from megalite.spawn import run_distributed

pytestmark = pytest.mark.slow  # launches processes

E, T, K, H = 8, 6, 2, 5


def routed_tokens(ranks: int):
    """Every rank's tokens, as one process sees them: [ranks, T, ...]."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(ranks, T, H, generator=g, dtype=torch.float64)
    indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(ranks * T)])
    probs = torch.rand(ranks * T, K, generator=g, dtype=torch.float64)
    keep = torch.rand(ranks * T, K, generator=g) > 0.2
    experts = torch.randn(E, H, H, generator=g, dtype=torch.float64)
    grad_out = torch.randn(ranks, T, H, generator=g, dtype=torch.float64)
    return (hidden, indices.view(ranks, T, K), probs.view(ranks, T, K), keep.view(ranks, T, K),
            experts, grad_out)


def reference(ranks: int):
    """Closed form: out[t] = sum_j keep * p * hidden[t] @ W[e]; and the rows each expert
    receives, in (source rank, token) order."""
    hidden, indices, probs, keep, experts, grad_out = routed_tokens(ranks)
    hidden, probs, experts = (x.clone().requires_grad_() for x in (hidden, probs, experts))
    out = torch.zeros_like(hidden)
    rows = {e: [] for e in range(E)}
    for r in range(ranks):
        for t in range(T):
            for j in range(K):
                if keep[r, t, j]:
                    e = int(indices[r, t, j])
                    out[r, t] = out[r, t] + probs[r, t, j] * (hidden[r, t] @ experts[e])
                    rows[e].append(hidden[r, t].detach())
    (out * grad_out).sum().backward()
    return out.detach(), rows, hidden.grad, probs.grad, experts.grad


def exchange(rank, ep, group, kind):
    """This rank's share of the EP `ep` run: outputs, rows and grads, for comparison."""
    ep_rank, first = rank % ep, (rank % ep) * (E // ep)
    hidden, indices, probs, keep, experts, grad_out = routed_tokens(ep)
    hidden, probs = hidden[ep_rank].clone().requires_grad_(), probs[ep_rank].clone().requires_grad_()
    mine = experts[first:first + E // ep].clone().requires_grad_()
    dispatcher = (AllToAllDispatch if kind == "alltoall" else AllGatherDispatch)(E, group)
    rows, counts = dispatcher.dispatch(hidden, probs, indices[ep_rank], keep[ep_rank])
    outputs = [x @ w for x, w in zip(rows.split(counts.tolist()), mine)]
    out = dispatcher.combine(torch.cat(outputs))
    (out * grad_out[ep_rank]).sum().backward()
    return out.detach(), rows.split(counts.tolist()), hidden.grad, probs.grad, mine.grad


def run_layouts(rank, world_size):
    pairs = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    results = {}
    for kind in ("alltoall", "allgather"):
        results[4, kind] = exchange(rank, 4, dist.group.WORLD, kind)
        results[2, kind] = exchange(rank, 2, pairs[rank // 2], kind)
    return results


def test_dispatch_and_combine_equal_one_process():
    ranks = run_distributed(4, run_layouts)
    for ep in (4, 2):
        out, rows, hidden_grad, probs_grad, expert_grad = reference(ep)
        for rank, result in enumerate(ranks):
            ep_rank, first = rank % ep, (rank % ep) * (E // ep)
            for kind in ("alltoall", "allgather"):
                got_out, got_rows, got_hidden, got_probs, got_experts = result[ep, kind]
                where = f"EP {ep} {kind} rank {rank}"
                torch.testing.assert_close(got_out, out[ep_rank], msg=where)
                for e, got in enumerate(got_rows):
                    want = rows[first + e]
                    assert torch.equal(got, torch.stack(want) if want else got[:0]), where
                torch.testing.assert_close(got_hidden, hidden_grad[ep_rank], msg=where)
                torch.testing.assert_close(got_probs, probs_grad[ep_rank], msg=where)
                torch.testing.assert_close(got_experts, expert_grad[first:first + E // ep],
                                           msg=where)
