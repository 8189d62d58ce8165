"""Sharded checkpoints (docs/design.md §8): storage.py makes directories visible atomically and
validates what it reads; saving.py writes each rank's shards; loading.py reads them back
at any layout."""

from megalite.checkpointing.loading import load_checkpoint
from megalite.checkpointing.saving import save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
