"""Context parallelism's load-balanced split of each sequence (docs/design.md §10).

A sequence of s tokens is cut into 2 x CP chunks of s / (2 CP); CP rank i holds chunks i
and 2 CP - 1 - i (`load_balanced_chunks`), so under the causal
mask every rank attends over the same number of (query, key) pairs. Everything indexed by
position follows the chunks: the data loader's tokens, labels and loss mask
(`shard_batch`, in the loader's workers: data/sampler.CollateContextShard) and the
positions the model embeds or rotates (`local_positions`, read by the embedding and the
RoPE table).
"""

import torch


def load_balanced_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2·cp_size sequence chunks CP rank `cp_rank` holds, in local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"CP rank {cp_rank} is outside a CP group of {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_length: int, cp_size: int, cp_rank: int,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of this CP rank's s / CP rows, in the order it holds them."""
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device)
                      for i in load_balanced_chunks(cp_size, cp_rank)])


def shard_batch(batch: dict[str, torch.Tensor], cp_size: int,
                cp_rank: int) -> dict[str, torch.Tensor]:
    """This CP rank's columns of every [micro batch, seq] tensor of a micro-batch."""
    if cp_size == 1:
        return batch
    seq = next(iter(batch.values())).shape[1]
    positions = local_positions(seq, cp_size, cp_rank)
    return {key: value[:, positions] for key, value in batch.items()}

