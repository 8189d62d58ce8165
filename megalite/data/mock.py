"""--mock-data: a synthetic corpus that needs no files and is learnable.

Like Megatron's mock GPT dataset, document d is the counting sequence 1, 2, ..., L_d,
here followed by an end-of-document token (the last id of the vocabulary); lengths are
drawn from a seeded generator. Every token but the one ending a document is predictable
from its predecessor, so a working model drives the loss far below log(vocab).
"""

import numpy as np
import torch

from megalite.documents import starts_from_eod
from megalite.errors import ConfigError


class MockGPTDataset:
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int,
                 documents: str | None = None):
        """`documents`: each sample's "document_starts" from its end-of-document tokens
        ("eod") or from the corpus's document lengths ("index"; the same here), or none."""
        if vocab_size < 3:
            raise ConfigError(f"--mock-data needs --vocab-size >= 3, got {vocab_size}")
        self.num_samples, self.documents = num_samples, documents
        self.seq_length = seq_length
        self.eod = vocab_size - 1
        self.max_document_length = vocab_size - 2  # ids 1..L stay below eod
        total_tokens = num_samples * seq_length + 1
        rng = np.random.default_rng(seed)
        # Mean document is (max+1)/2 + 1 tokens; draw enough documents to cover the stream.
        num_docs = int(total_tokens / ((self.max_document_length + 1) / 2 + 1) * 1.1) + 16
        self.lengths = rng.integers(1, self.max_document_length + 1, size=num_docs)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths + 1)[:-1]])
        if self.starts[-1] < total_tokens:
            raise RuntimeError("mock corpus too short; the document count estimate is wrong")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        """seq_length + 1 consecutive stream tokens; consecutive samples share one."""
        positions = np.arange(index * self.seq_length, (index + 1) * self.seq_length + 1)
        doc = np.searchsorted(self.starts, positions, side="right") - 1
        offset = positions - self.starts[doc]
        tokens = torch.from_numpy(np.where(offset < self.lengths[doc], offset + 1, self.eod))
        sample = {"tokens": tokens[:-1], "labels": tokens[1:],
                  "loss_mask": torch.ones(self.seq_length)}
        if self.documents == "eod":
            sample["document_starts"] = starts_from_eod(sample["tokens"], self.eod)
        elif self.documents == "index":  # a document is its tokens and its eod
            first = np.searchsorted(doc, doc, side="left")[:-1]
            sample["document_starts"] = torch.from_numpy(first)
        return sample
