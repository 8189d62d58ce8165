"""Reading a torch_dist (torch.distributed.checkpoint) Megatron checkpoint: reader.py's
torch_dist half, a module of its own because importing torch.distributed.checkpoint pulls in
DTensor, seconds per process that every run would pay; reader.py imports it only when it
meets such a checkpoint."""

import io
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner,
                                                         create_default_local_load_plan)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, StorageMeta,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megalite.errors import CheckpointError
from megalite.megatron_checkpoint import layout
from megalite.megatron_checkpoint.safe_pickle import load_dcp_metadata, torch_load


class _SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled with an allow-list."""

    def read_metadata(self, *args, **kwargs):
        metadata = load_dcp_metadata(Path(self.path) / ".metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _RawBytesPlanner(DefaultLoadPlanner):
    """Keeps pickled objects as bytes (the default planner unpickles them unrestricted), and
    reads only `rows` (key -> range of layers) of the stacked tensors named there."""

    def __init__(self, rows: dict[str, range]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.rows = rows

    def create_local_plan(self):
        whole = {k: v for k, v in self.state_dict.items() if k not in self.rows}
        plan = create_default_local_load_plan(whole, self.metadata)
        for key, rows in self.rows.items():
            size = self.metadata.state_dict_metadata[key].size
            chunk = ChunkStorageMetadata(torch.Size([rows.start] + [0] * (len(size) - 1)),
                                         torch.Size([len(rows), *size[1:]]))
            plan.items += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], [chunk])
        return plan

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]  # a key in `rows` holds just those rows

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = value.getvalue()


def _is_model_key(key: str) -> bool:
    return key.startswith(("embedding.", "decoder.", "mtp.", "output_layer.")) and \
        "_extra_state" not in key


def _layer_rows(key: str, layers: int, names: set[str] | None) -> range:
    """The rows of stacked `key` (one per layer) whose megalite names are in `names`."""
    rest = layout.megalite_name(key)[len(layout.LAYER_PREFIX):]
    held = [i for i in range(layers) if names is None or
            f"{layout.LAYER_PREFIX}{i}.{rest}" in names]
    return range(held[0], held[-1] + 1) if held else range(0)


def read(directory: Path, names: set[str] | None) -> tuple[dict[str, torch.Tensor], dict]:
    """(megalite's state dict of `names`, default all; the common state) of `directory`."""
    metadata = load_dcp_metadata(directory / ".metadata")
    entries = metadata.state_dict_metadata
    common_keys = [k for k in entries if k.startswith("common_state")]
    rows, template = {}, {}
    for k, m in entries.items():
        if not (isinstance(m, TensorStorageMetadata) and _is_model_key(k)):
            continue
        size = m.size
        if k.startswith(layout.LAYER_PREFIX):  # stacked: [num_layers, ...]
            held = _layer_rows(k, size[0], names)
            if not held:
                continue
            rows[k], size = held, torch.Size([len(held), *size[1:]])
        elif names is not None and layout.megalite_name(k) not in names:
            continue
        template[k] = torch.empty(size, dtype=m.properties.dtype)
    template.update({k: b"" for k in common_keys})
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise CheckpointError(f"torch_dist checkpoint {directory} is incomplete: its .metadata "
                              f"lists {files}, missing {missing}")
    planner = _RawBytesPlanner(rows)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(template, storage_reader=_SafeReader(directory), planner=planner,
                     no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as error:  # e.g. a truncated .distcp file
        reason = str(error).strip().splitlines()[-1]
        raise CheckpointError(f"torch_dist checkpoint {directory} is unreadable: "
                              f"{reason}") from error
    common = _common_state(directory, common_keys, planner.state_dict)
    state = {}
    for key in template:
        if key in common_keys:
            continue
        tensor, name = planner.state_dict[key], layout.megalite_name(key)
        if key in rows:  # the rows `rows[key]` of [num_layers, ...]
            rest = name[len(layout.LAYER_PREFIX):]
            for i, layer in zip(rows[key], tensor.unbind(0)):
                layer_name = f"{layout.LAYER_PREFIX}{i}.{rest}"
                if names is None or layer_name in names:
                    state[layer_name] = layer.clone()
        else:
            state[name] = tensor
    return state, common


def _common_state(directory: Path, keys: list[str], loaded: dict) -> dict:
    """Megatron's common state: a pickled [dict] in the DCP, or common.pt beside it."""
    if (directory / "common.pt").is_file():
        common = torch_load(directory / "common.pt", str(directory / "common.pt"))
    elif keys:
        common = torch_load(loaded[keys[0]], f"{directory} ({keys[0]})")
        common = common[0] if isinstance(common, list) and len(common) == 1 else common
    else:
        raise CheckpointError(f"torch_dist checkpoint {directory} has no common state "
                              f"(no common.pt and no common_state entry)")
    if not isinstance(common, dict):
        raise CheckpointError(f"torch_dist checkpoint {directory}: its common state is a "
                              f"{type(common).__name__}, not a dict")
    return common
