"""Documents in packed samples (docs/design.md §28; Megatron's --reset-position-ids,
--reset-attention-mask, --dataloader-inter-document-masking).

A sample of s tokens holds documents end to end. The data loader hands, per sample, each
token's document start (`document_starts[i]`: the position in the sample of the first token
of i's document), one int per token rather than Megatron's padded cu_seqlens: it collates at
a fixed shape and follows the sequence wherever context parallelism sends its tokens
(context_split.shard_batch), so a CP rank holds the starts of exactly its rows. From it:

- positions restart in each document: position_ids[i] = i - start[i];
- attention is block-causal: query i sees key j iff start[i] <= j <= i;
- the runs of rows sharing a start are the documents (cu_seqlens), which the kernels that
  take boundaries are fed instead of an [s, s] mask (attention_backends.py).
"""

from collections import defaultdict
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F


def starts_from_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[..., s] input tokens -> [..., s] document starts. A document ends with its EOD token:
    the token after an EOD starts the next one (Megatron's get_ltor_masks_and_position_ids)."""
    s = tokens.shape[-1]
    after_eod = torch.where(tokens == eod, torch.arange(1, s + 1, device=tokens.device), 0)
    # start[i] = max over j < i of after_eod[j]: the position after the last EOD before i.
    return F.pad(after_eod[..., :-1], (1, 0)).cummax(dim=-1).values


def starts_from_lengths(lengths: Sequence[int], s: int) -> torch.Tensor:
    """[s] document starts of a sample cut from documents of `lengths` tokens in order (the
    first may be a document's tail, the last is cut at s): the dataset's own boundaries."""
    lengths = torch.tensor(lengths, dtype=torch.int64)
    return torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)[:s]


class Run(NamedTuple):
    """A document's query rows [row_begin, row_end) of the rows it was cut from, and the
    keys they see, global positions [key_begin, key_end); the rows are the last of those
    keys (causal, aligned to the lower right)."""
    row_begin: int
    row_end: int
    key_begin: int
    key_end: int


class Documents:
    """The documents of a micro-batch's rows: `starts` [b, n] (document starts, global
    positions), `positions` [n] (the rows' global positions: arange, or a CP rank's two
    chunks, context_split.local_positions). Host-side runs are computed once and shared by
    every layer of a forward."""

    def __init__(self, starts: torch.Tensor, positions: torch.Tensor):
        self.starts, self.positions = starts, positions.to(starts.device)
        self._runs: list[list[Run]] | None = None
        self.cache: dict = {}  # kernel-specific views (a flex block mask, cu_seqlens)

    def position_ids(self) -> torch.Tensor:
        """[b, n]: each row's position within its document."""
        return self.positions - self.starts

    def rows(self, rows: slice) -> "Documents":
        """The documents of these rows only (kept: every layer asks for the same rows)."""
        key = ("rows", rows.start, rows.stop)
        if key not in self.cache:
            self.cache[key] = Documents(self.starts[:, rows], self.positions[rows])
        return self.cache[key]

    def visible(self, key_positions: torch.Tensor) -> torch.Tensor:
        """[b, n, k] bool: whether each row sees each key (global positions)."""
        q = self.positions[None, :, None]
        k = key_positions.to(self.starts.device)[None, None, :]
        return (self.starts[:, :, None] <= k) & (k <= q)

    def runs(self) -> list[list[Run]]:
        """Per sample, the rows' documents in row order; a run never spans two chunks of
        non-consecutive positions. One host sync per forward, not per layer."""
        if self._runs is None:
            b, n = self.starts.shape
            cut = (self.starts[:, 1:] != self.starts[:, :-1]) | \
                (self.positions[1:] != self.positions[:-1] + 1)
            cuts = cut.nonzero().tolist()
            starts, positions = self.starts.tolist(), self.positions.tolist()
            edges = [[0] for _ in range(b)]
            for sample, row in cuts:
                edges[sample].append(row + 1)
            self._runs = [[Run(r0, r1, starts[i][r0], positions[r1 - 1] + 1)
                           for r0, r1 in zip(e, e[1:] + [n])] for i, e in enumerate(edges)]
        return self._runs

    def padded_batches(self, s_k: int) -> "PaddedBatches":
        """The runs as padded batches for a kernel with an upper-left causal mask (SDPA's
        is_causal), one per length bucket: a run's keys fill the first rows of its padded
        sequence and its queries end where its keys end, so each sees exactly its causal
        keys and never the padding after them (whose rows are zeros, outputs dropped)."""
        key = ("padded", s_k)
        if key not in self.cache:
            self.cache[key] = _padded_batches(self.runs(), self.starts.shape[1], s_k,
                                              self.starts.device)
        return self.cache[key]

    def first_visible_key(self, rows: slice) -> int:
        """The smallest global key position any of these rows sees (over the batch)."""
        return min(runs[0].key_begin for runs in self.rows(rows).runs())


class PaddedBatches(NamedTuple):
    """Documents.padded_batches: the buckets' (sequences, padded length), in order, and the
    one-to-one gathers between the flat rows (sample x row) and the buckets' padded rows,
    laid end to end (`gather_rows`): queries and keys into the batches, outputs back."""
    shapes: list[tuple[int, int]]
    queries: tuple[torch.Tensor, torch.Tensor]
    keys: tuple[torch.Tensor, torch.Tensor]
    outputs: tuple[torch.Tensor, torch.Tensor]


def _padded_batches(runs: list[list[Run]], n: int, s_k: int, device) -> PaddedBatches:
    buckets = defaultdict(list)
    for sample, sample_runs in enumerate(runs):
        for r in sample_runs:
            buckets[bucket_length(r.key_end - r.key_begin)].append((sample, r))
    shapes, queries, keys = [], [], []
    for length, members in sorted(buckets.items()):
        q = np.full((len(members), length), -1, dtype=np.int64)  # -1: padding
        k = np.full_like(q, -1)
        for m, (sample, r) in enumerate(members):
            num_keys, num_rows = r.key_end - r.key_begin, r.row_end - r.row_begin
            q[m, num_keys - num_rows:num_keys] = sample * n + np.arange(r.row_begin, r.row_end)
            k[m, :num_keys] = sample * s_k + np.arange(r.key_begin, r.key_end)
        shapes.append(q.shape)
        queries.append(q.ravel())
        keys.append(k.ravel())
    q, k = np.concatenate(queries), np.concatenate(keys)
    q_gather = _gather_pair(q, len(runs) * n, device)
    return PaddedBatches(shapes, q_gather, _gather_pair(k, len(runs) * s_k, device),
                         q_gather[::-1])


def _gather_pair(index: np.ndarray, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, inverse) for gather_rows: `index` [m] takes row index[i] (-1: a zero row)
    from `rows` rows, each at most once; `inverse` [rows] says where each row went (m for
    nowhere: its gradient is zero)."""
    taken = index >= 0
    if np.unique(index[taken]).size != taken.sum():
        raise ValueError("documents' key ranges overlap; a run takes each key at most once")
    inverse = np.full(rows, index.size, dtype=np.int64)
    inverse[index[taken]] = np.nonzero(taken)[0]
    forward = np.where(taken, index, rows)
    return (torch.from_numpy(forward).to(device), torch.from_numpy(inverse).to(device))


class _GatherRows(torch.autograd.Function):
    """x[index] along dim 0, with row len(x) a zero row; each row taken at most once, so the
    backward is the gather of the gradient by `inverse`, never a scatter-add (torch's
    index_select backward), which costs more than the attention on CPUs."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return _with_zero_row(x).index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _with_zero_row(grad).index_select(0, inverse), None, None


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def gather_rows(x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [rows, ...] gathered by one of PaddedBatches' (index, inverse) pairs."""
    return _GatherRows.apply(x, *pair)


SHORTEST_BUCKET = 16
"""The padded length of every run of at most 16 keys."""


def bucket_length(n: int) -> int:
    """The padded length of a run of n keys: the next of 16, 24, 32, 48, ... (2^k and
    3·2^(k-1)), so at most a third of a padded side is padding: at most 1.5 n for n >= 11
    (n = 2^k + 1 pads to 3·2^(k-1)), SHORTEST_BUCKET below."""
    length = SHORTEST_BUCKET
    while length < n:
        length = length * 3 // 2 if length & (length - 1) == 0 else length * 4 // 3
    return length
