"""Ring wire bytes one rank sends per step under hybrid sharding (docs/design.md §27): the
closed forms the log line, the layout tuner and benchmarks/hsdp_bytes.py share.

With N replicas of S ranks (a shard group), Ψ_S the parameters padded to shard boundaries
(ZeRO-1: each bucket to a multiple of S; FSDP2: each parameter's rows to a multiple of S),
b bytes per gradient element and b_p per gathered parameter element:

    within the shard group   (S-1)/S x Ψ_S (b + g b_p)   reduce-scatter + g all-gathers
                             (g = 1: ZeRO-1 and FSDP2 optim_grads; 2: FSDP2's ZeRO-3)
    across replicas          2(N-1)/N x Ψ_S / S x b       all-reduce of this rank's shard
"""

import math


def algorithm_factor(op: str, n: int) -> float:
    """A ring collective's bytes sent per rank over the message size, for n ranks:
    nccl-tests' busbw / algbw."""
    return {"all-reduce": 2 * (n - 1) / n, "p2p": 1.0}.get(op, (n - 1) / n)


def shard_group_bytes(padded_numel: int, s: int, grad_bytes: int, param_bytes: int,
                      gathers: int) -> float:
    """Bytes sent within a shard group of `s` ranks: the gradients' reduce-scatter and
    `gathers` parameter all-gathers of `padded_numel` (Ψ_S) elements."""
    return algorithm_factor("reduce-scatter", s) * padded_numel * (grad_bytes
                                                                    + gathers * param_bytes)


def cross_replica_bytes(shard_numel: int, n: int, grad_bytes: int) -> float:
    """Bytes sent across `n` replicas: the all-reduce of this rank's `shard_numel`-element
    gradient shard (Ψ_S / S)."""
    return algorithm_factor("all-reduce", n) * shard_numel * grad_bytes


def fsdp_padded_numel(shape: tuple[int, ...], s: int) -> int:
    """A parameter's elements with its rows (dim 0, torch.chunk's) padded to a multiple of
    `s`: what FSDP2 reduce-scatters for it."""
    return -(-shape[0] // s) * s * math.prod(shape[1:])
