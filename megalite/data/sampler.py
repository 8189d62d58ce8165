"""Which samples each data-parallel rank reads, step by step (docs/design.md §3).

Global batch b is samples [b*G, (b+1)*G) of the dataset, whatever the data-parallel size:
DP rank r takes the contiguous slice [r*G/dp, (r+1)*G/dp) of it and cuts that into
micro-batches (with uneven shares, data/shares.py, the slice after the ranks before it).
So the samples of a step, and their order when the ranks' slices are put side by side, do
not depend on the layout. Like Megatron's pretraining sampler it starts at
`consumed_samples` (from the checkpoint), so a resumed run reads exactly what an
uninterrupted one would have read from there, and it drops a final partial global batch.
(Megatron hands rank r the r-th micro-batch of every dp*micro_batch_size chunk instead:
same samples per step, a different split among ranks.)
"""

from typing import Iterator, Sequence

import torch

from megalite.context_split import shard_batch
from megalite.errors import ConfigError
from megalite.parallel_state import num_microbatches


class MicroBatchSampler:
    """Yields this DP rank's micro-batches (lists of sample indices) from `consumed_samples`.

    Use as `DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_samples)`.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, global_batch_size: int,
                 shares: tuple[int, ...] | None = None):
        """`shares`: micro-batches of each DP rank per global batch (data/shares.py);
        None: the same number each."""
        if micro_batch_size < 1 or data_parallel_size < 1 or global_batch_size < 1:
            raise ConfigError(f"--micro-batch-size ({micro_batch_size}), data-parallel size "
                              f"({data_parallel_size}) and --global-batch-size "
                              f"({global_batch_size}) must be >= 1")
        if shares is not None and (len(shares) != data_parallel_size
                                   or sum(shares) * micro_batch_size != global_batch_size):
            raise ConfigError(f"data-parallel shares {list(shares)} (micro-batches per DP "
                              f"rank) x --micro-batch-size {micro_batch_size} do not make "
                              f"--global-batch-size {global_batch_size} over "
                              f"{data_parallel_size} ranks")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ConfigError(f"data-parallel rank {data_parallel_rank} not in "
                              f"[0, {data_parallel_size})")
        if consumed_samples < 0 or consumed_samples % global_batch_size != 0:
            raise ConfigError(f"consumed samples {consumed_samples} (from the checkpoint) is not "
                              f"a whole number of global batches of --global-batch-size "
                              f"{global_batch_size}; resume with the global batch size the "
                              "checkpoint was trained with")
        if consumed_samples > total_samples:
            raise ConfigError(f"consumed samples {consumed_samples} (from the checkpoint) exceed "
                              f"the {total_samples} samples of the dataset")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        shares = shares or (num_microbatches(global_batch_size, micro_batch_size,
                                             data_parallel_size),) * data_parallel_size
        # This rank's samples follow those of the ranks before it (uneven shares or not).
        self.local_batch_size = shares[data_parallel_rank] * micro_batch_size
        self.local_start = sum(shares[:data_parallel_rank]) * micro_batch_size

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        global_batches = (self.total_samples - self.consumed_samples) // self.global_batch_size
        return global_batches * (self.local_batch_size // self.micro_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        G, mbs = self.global_batch_size, self.micro_batch_size
        for batch_start in range(self.consumed_samples, self.total_samples - G + 1, G):
            local_start = batch_start + self.local_start
            for start in range(local_start, local_start + self.local_batch_size, mbs):
                yield list(range(start, start + mbs))


def collate_samples(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a micro-batch's samples: each key becomes a [micro_batch_size, ...] tensor."""
    keys = samples[0].keys()
    for sample in samples[1:]:
        if sample.keys() != keys:
            raise ValueError(f"samples of one micro-batch differ in keys: "
                             f"{sorted(keys)} vs {sorted(sample.keys())}")
    return {key: torch.stack([sample[key] for sample in samples]) for key in keys}


def add_mtp_targets(batch: dict[str, torch.Tensor], depths: int) -> dict[str, torch.Tensor]:
    """`batch` with the targets of multi-token prediction's depths k = 1..`depths`
    (model/mtp.py), [micro batch, seq, depths]: "mtp_labels"[..., k-1], the labels k places
    on (the token k + 1 ahead), and "mtp_loss_mask"[..., k-1], their loss mask; past the
    end of the sample 0 and masked out, as Megatron's roll_tensor fills. Shifted on the
    whole sample, before the CP split, so no CP rank needs another's tokens."""
    if depths == 0:
        return batch

    def shifted(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.cat([x[:, k:], x.new_zeros(x.shape[0], k)], dim=1)
                            for k in range(1, depths + 1)], dim=-1)
    return {**batch, "mtp_labels": shifted(batch["labels"]),
            "mtp_loss_mask": shifted(batch["loss_mask"])}


class CollateContextShard:
    """collate_fn of the data loader: stack the micro-batch's samples, add the MTP targets
    of `mtp_depths` (--mtp-num-layers), keep this CP rank's columns (a class, not a
    closure: the loader's workers unpickle it)."""

    def __init__(self, cp_size: int, cp_rank: int, mtp_depths: int = 0):
        self.cp_size, self.cp_rank, self.mtp_depths = cp_size, cp_rank, mtp_depths

    def __call__(self, samples) -> dict[str, torch.Tensor]:
        batch = add_mtp_targets(collate_samples(samples), self.mtp_depths)
        return shard_batch(batch, self.cp_size, self.cp_rank)
