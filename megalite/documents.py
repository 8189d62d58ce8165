"""Documents in packed samples (docs/design.md §27; Megatron's --reset-position-ids,
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

from typing import NamedTuple, Sequence

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
    starts = torch.empty(s, dtype=torch.int64)
    begin = 0
    for length in lengths:
        if begin >= s:
            break
        starts[begin:begin + length] = begin
        begin += length
    return starts


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

    def first_visible_key(self, rows: slice) -> int:
        """The smallest global key position any of these rows sees (over the batch)."""
        return min(runs[0].key_begin for runs in self.rows(rows).runs())
