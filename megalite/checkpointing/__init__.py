"""Sharded checkpoints (docs/design.md §8): state.py gathers what a checkpoint holds in one
object (CheckpointState); saving.py writes each rank's shards of it; loading.py reads them
back at any layout; storage.py makes directories visible atomically and validates what it
reads."""

from megalite.checkpointing.loading import load_checkpoint
from megalite.checkpointing.saving import save_checkpoint
from megalite.checkpointing.state import CheckpointState

__all__ = ["CheckpointState", "load_checkpoint", "save_checkpoint"]
