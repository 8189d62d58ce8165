"""Reading Megatron's pickles without running them (docs/design.md §8: never a plain unpickle).

Megatron's files are pickles of more than tensors: the legacy `model_optim_rng.pt` and the
torch_dist common state hold the run's `argparse.Namespace` (with torch dtypes, and in
recent versions Megatron enums), the legacy RNG state holds NumPy arrays, and the
torch_dist `.metadata` is a plain pickle of torch.distributed.checkpoint's own dataclasses.
Each is read by an unpickler that builds only the globals on an explicit allow-list; any
other global is refused with a CheckpointError naming the file and the global, before
anything in the file runs.
"""

import argparse
import io
import pickle
import zipfile
from pathlib import Path

import numpy as np
import torch

from megalite.checkpointing.storage import guarded_load
from megalite.errors import CheckpointError


class MegatronEnum:
    """Stands in for a Megatron enum member in a pickled args Namespace (e.g.
    `attention_backend=AttnBackend.auto`): enums pickle as `Class(value)`, and megalite
    needs only the value, never Megatron itself."""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return f"MegatronEnum({self.value!r})"


# Enums a Megatron args Namespace is known to hold, each read as a MegatronEnum.
_MEGATRON_ENUMS = ("megatron.core.transformer.enums.AttnBackend",
                   "megatron.core.transformer.enums.AttnMaskType",
                   "megatron.core.enums.ModelType",
                   "megatron.core.transformer.enums.ModelType")

# torch.load(weights_only=True) already builds tensors, torch dtypes and plain containers;
# these are the extra globals a Megatron checkpoint holds.
TORCH_LOAD_ALLOWED = [argparse.Namespace, io.BytesIO,
                      getattr(np, "_core", None) and np._core.multiarray._reconstruct
                      or np.core.multiarray._reconstruct,
                      np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                      *[(MegatronEnum, name) for name in _MEGATRON_ENUMS]]

# The globals of a torch.distributed.checkpoint `.metadata` pickle (its dataclasses).
_DCP = "torch.distributed.checkpoint."
DCP_METADATA_ALLOWED = {
    (_DCP + "metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    (_DCP + "planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType",
                                    "TensorWriteData")} | {
    (_DCP + "filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization",
                                                              "_get_layout"),
    ("collections", "OrderedDict"), ("pathlib", "PosixPath")} | {
    ("torch", str(d).removeprefix("torch.")) for d in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool)}


def torch_load(source: Path | bytes, what: str):
    """`source` (a path or bytes) by storage.guarded_load with TORCH_LOAD_ALLOWED; `what`
    names it in errors. A file in torch.save's zip format is memory-mapped: a tensor the
    caller never touches (another rank's, an optimizer state it does not load) is never
    read."""
    stream = io.BytesIO(source) if isinstance(source, bytes) else Path(source)
    mmap = isinstance(stream, Path) and stream.is_file() and zipfile.is_zipfile(stream)
    return guarded_load(stream, f"Megatron checkpoint file {what}", TORCH_LOAD_ALLOWED,
                        mmap=mmap)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) not in DCP_METADATA_ALLOWED:
            raise CheckpointError(f"torch_dist metadata {self.path} holds the global "
                                  f"{module}.{name}, which megalite does not load (nothing in "
                                  f"it was run)")
        return super().find_class(module, name)


def load_dcp_metadata(path: Path):
    """The torch.distributed.checkpoint Metadata pickled in `path` (`.metadata`)."""
    if not path.is_file():
        raise CheckpointError(f"torch_dist checkpoint {path.parent} has no {path.name}")
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"torch_dist metadata {path} is unreadable: {error!r}") from error
