"""Reading a Megatron-LM checkpoint directory, in either format, at any TP/PP layout.

`<load>/latest_checkpointed_iteration.txt` names `iter_XXXXXXX/` (or `release/`), which is:
- torch_dist (Megatron's default): a torch.distributed.checkpoint directory (`.metadata`,
  `__*_*.distcp`, Megatron's `metadata.json`). Every tensor is stored as its global,
  TP- and PP-independent value, the layers stacked on a leading dimension; the common
  state (`iteration`, `args`, ...) is a pickled object in it (or `common.pt` beside it).
  It is read with torch.distributed.checkpoint's own FileSystemReader and load, in one
  process, with the pickled parts unpickled by safe_pickle.
- torch (legacy): `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` per (TP, PP[, EP]) rank, a
  torch.save of {"model", "iteration", "args", "checkpoint_version", ...} whose tensors are
  that rank's shards (layers numbered from 0 on each stage, experts from 0 on each EP
  rank: moe.py); merged as Megatron shards them.
Either way the result is megalite's single-process state dict (layout.py's names) and the
GPTConfig the checkpoint's args describe, checked against each other. A rank loading with
`names` (its chunks' parameters) reads only those: the legacy files of the saved stages
holding them (memory-mapped, so an optimizer entry it does not keep is never read), the
rows of torch_dist's stacked layers that are its own.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megalite.checkpointing.storage import RELEASE, TRACKER_FILENAME, tracked_checkpoint
from megalite.errors import CheckpointError
from megalite.megatron_checkpoint import layout, mla, moe
from megalite.megatron_checkpoint.safe_pickle import torch_load
from megalite.config import GPTConfig
from megalite.tensor_parallel.params import partition_dim, partition_stride, tp_unshard

FORMATS = ("torch", "torch_dist")
LEGACY_FILE = "model_optim_rng.pt"
_MP_RANK = re.compile(r"mp_rank_(\d\d)(?:_(\d\d\d))?(?:_(\d\d\d))?")


@dataclass
class MegatronCheckpoint:
    directory: Path
    """The iteration directory read."""
    ckpt_format: str
    iteration: int
    args: object
    """The run's argparse.Namespace."""
    config: GPTConfig
    state: dict[str, torch.Tensor]
    """megalite's single-process state dict (padded vocabulary rows as saved)."""
    common: dict
    """Everything else of the common state (iteration, opt_param_scheduler, ...)."""
    optimizer_shards: dict = field(default_factory=dict)
    """Legacy format: (tp, pp) -> (parameter names in saved order, their shard shapes, the
    file's `optimizer` entry), for optimizer_state.py."""

    def consumed(self, split: str) -> int:
        """The run's consumed samples of `split` ("train" or "valid")."""
        return int(getattr(self.args, f"consumed_{split}_samples", 0) or 0)

    @property
    def scheduler_steps(self) -> int:
        """The learning-rate scheduler's step; Megatron's counts samples."""
        return self.common.get("opt_param_scheduler", {}).get("num_steps",
                                                              self.consumed("train"))


def iteration_dir(load: str | Path) -> tuple[int, Path] | None:
    """(iteration, directory) the Megatron tracker in `load` names; None without one."""
    load = Path(load)
    return tracked_checkpoint(load) if (load / TRACKER_FILENAME).is_file() else None


def formats_present(directory: Path) -> list[str]:
    """The Megatron formats `directory` holds, torch_dist first (none: e.g. megalite's)."""
    found = ["torch_dist"] if (directory / ".metadata").is_file() else []
    if directory.is_dir() and any(_MP_RANK.fullmatch(p.name) for p in directory.iterdir()):
        found.append("torch")
    return found


def is_megatron_checkpoint(load: str | Path) -> bool:
    """Whether the tracker in `load` names a Megatron-format directory (a garbled tracker
    is not: megalite's own checkpoint loading names what is wrong with it)."""
    try:
        found = iteration_dir(load)
    except (CheckpointError, OSError, UnicodeDecodeError):
        return False
    return found is not None and bool(formats_present(found[1]))


def read_checkpoint(load: str | Path, ckpt_format: str | None = None,
                    names: set[str] | None = None, optimizer: bool = True) -> MegatronCheckpoint:
    """The checkpoint the tracker in `load` names; `ckpt_format` forces a format. `names`:
    the only parameters to read (default all); `optimizer`: keep the legacy Adam state."""
    found = iteration_dir(load)
    if found is None:
        raise CheckpointError(f"{load} is not a Megatron checkpoint directory: no "
                              f"{TRACKER_FILENAME}")
    iteration, directory = found
    if not directory.is_dir():
        raise CheckpointError(f"Megatron checkpoint {directory}, named by the tracker in "
                              f"{load}, does not exist")
    present = formats_present(directory)
    if not present:
        raise CheckpointError(f"{directory} is neither Megatron format: no torch_dist "
                              f".metadata and no mp_rank_* directories")
    fmt = ckpt_format or present[0]
    if fmt not in present:
        raise CheckpointError(f"{directory} is not a --ckpt-format {fmt} checkpoint (it "
                              f"holds {' and '.join(present)})")
    ckpt = (_read_torch_dist(directory, names) if fmt == "torch_dist" else
            _read_legacy(directory, names, optimizer))
    if directory.name != RELEASE and ckpt.iteration != iteration:
        raise CheckpointError(f"Megatron checkpoint {directory} records iteration "
                              f"{ckpt.iteration}, the tracker says {iteration}")
    return ckpt


# --- legacy torch -------------------------------------------------------------------------

def legacy_rank_dir(tp: int, pp: int, pp_size: int, ep: int = 0, ep_size: int = 1) -> str:
    """Megatron's directory of one rank's legacy file (the EP rank last, with EP > 1)."""
    name = f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return name if ep_size == 1 else f"{name}_{ep:03d}"


def _saved_stage(name: str, stages: list[range]) -> int:
    """The pipeline stage of the saved layout that holds `name` (Megatron's placement)."""
    if name.startswith(layout.LAYER_PREFIX):
        layer = int(name[len(layout.LAYER_PREFIX):].split(".", 1)[0])
        return next(p for p, held in enumerate(stages) if layer in held)
    return 0 if name.startswith("embedding.") else len(stages) - 1


def _read_legacy(directory: Path, names: set[str] | None, optimizer: bool) -> MegatronCheckpoint:
    present = sorted(p.name for p in directory.iterdir() if _MP_RANK.fullmatch(p.name))
    first_path = directory / present[0] / LEGACY_FILE
    first = torch_load(first_path, str(first_path))
    args = _field(first, "args", first_path)
    config = layout.config_from_args(args, str(directory))
    tp = getattr(args, "tensor_model_parallel_size", 1)
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    if getattr(args, "expert_tensor_parallel_size", None) not in (None, tp):
        raise CheckpointError(f"Megatron checkpoint {directory}: expert_tensor_parallel_size="
                              f"{args.expert_tensor_parallel_size} differs from TP {tp}; megalite "
                              f"reads such experts from a --ckpt-format torch_dist save")
    expected = [legacy_rank_dir(t, p, pp, e, ep) for p in range(pp) for t in range(tp)
                for e in range(ep)]
    missing = [d for d in expected if not (directory / d / LEGACY_FILE).is_file()]
    if missing:
        raise CheckpointError(f"Megatron checkpoint {directory} (TP {tp}, PP {pp}, EP {ep}) is "
                              f"missing shards: {[f'{d}/{LEGACY_FILE}' for d in missing]}")
    stages = layout.stage_layers(config.num_layers, pp, str(directory))
    if names is not None:
        names = names & set(layout.meta_params(config))
    read = range(pp) if names is None else sorted({_saved_stage(n, stages) for n in names})
    shards: dict[str, list[torch.Tensor]] = {}
    experts: dict[str, list[dict[int, torch.Tensor]]] = {}
    optimizer_shards = {}
    for p in read:
        for t in range(tp):
            for e in range(ep):
                path = directory / legacy_rank_dir(t, p, pp, e, ep) / LEGACY_FILE
                record = first if path == first_path else torch_load(path, str(path))
                saved, shapes = _read_legacy_model(
                    _field(record, "model", path), config, stages[p].start, names, shards,
                    experts, (t, tp, e, ep), str(path))
                if optimizer and "optimizer" in record and e == 0:
                    optimizer_shards[t, p] = (saved, shapes, record["optimizer"])
    _stack_experts(experts, shards, config, str(directory))
    state = _merge_tensor_parallel(shards, config, tp, str(directory), names)
    common = {k: v for k, v in first.items() if k not in ("model", "args", "optimizer")}
    return MegatronCheckpoint(directory, "torch", int(first.get("iteration", 0)), args, config,
                              state, common, optimizer_shards)


def _read_legacy_model(model: dict, config: GPTConfig, first_layer: int, names: set | None,
                       shards: dict, experts: dict, rank: tuple[int, int, int, int],
                       where: str) -> tuple[list[str], dict]:
    """Adds one file's tensors to `shards` (name -> TP pieces) and its experts to `experts`
    (stacked name -> per TP rank {global expert: tensor}); returns its names in saved order
    and their shapes (for optimizer_state.py). Tensors replicated over EP are taken from EP
    rank 0."""
    t, tp, e, ep = rank
    saved, shapes = [], {}
    for name, tensor in model.items():
        name = layout.megalite_name(name)
        if name is None:
            continue  # extra state
        name = layout.local_layer_name(name, -first_layer)
        expert = moe.legacy_expert(name, where)
        if expert is not None:
            stacked, local = expert
            if names is None or stacked in names:
                per_tp = experts.setdefault(stacked, [{} for _ in range(tp)])
                per_tp[t][e * (config.num_experts // ep) + local] = tensor
            continue
        if e > 0:
            continue
        saved.append(name)
        shapes[name] = tensor.shape
        if name == layout.OUTPUT and not config.untie_embeddings_and_output_weights:
            continue  # a tied output layer (PP > 1) is the embedding's copy
        if first_layer > 0 and name.startswith("embedding."):
            continue  # the MTP's copy on the last stage: the first stage's is read
        if names is None or name in names:
            shards.setdefault(name, []).append(tensor)
    return saved, shapes


def _stack_experts(experts: dict, shards: dict, config: GPTConfig, where: str) -> None:
    """Each TP rank's experts stacked in global order: that rank's shard of megalite's
    [E, ...] tensor (moe.py)."""
    for name, per_tp in experts.items():
        for t, held in enumerate(per_tp):
            if sorted(held) != list(range(config.num_experts)):
                raise CheckpointError(f"Megatron checkpoint {where}: TP rank {t} holds experts "
                                      f"{sorted(held)} of {name}, expected 0..."
                                      f"{config.num_experts - 1}")
            shards.setdefault(name, []).append(
                torch.stack([held[i] for i in range(config.num_experts)]))


def _field(record, key: str, path: Path):
    if not isinstance(record, dict) or key not in record:
        raise CheckpointError(f"{path} is not a Megatron checkpoint file: no {key!r} entry")
    return record[key]


def _merge_tensor_parallel(shards: dict[str, list[torch.Tensor]], config: GPTConfig, tp: int,
                           where: str, names: set[str] | None) -> dict[str, torch.Tensor]:
    """Full tensors from each name's TP shards (params.tp_unshard, Megatron's split)."""
    params = layout.meta_params(config)
    state = {}
    for name, pieces in shards.items():
        param = params.get(name)
        if param is None:
            state[name] = pieces[0]  # layout.check_state names it as unexpected
            continue
        dim = mla.shard_dim(name, pieces, param.shape[0], partition_dim(param))
        if len(pieces) != tp:
            raise CheckpointError(f"Megatron checkpoint {where}: {name} is in {len(pieces)} "
                                  f"of {tp} TP shards")
        try:
            state[name] = tp_unshard(pieces, dim, partition_stride(param))
        except RuntimeError as error:
            raise CheckpointError(f"Megatron checkpoint {where}: the TP shards of {name} do "
                                  f"not fit together ({[tuple(p.shape) for p in pieces]}): "
                                  f"{error}") from error
    layout.check_state(state, config, where, names)
    return state


# --- torch_dist ---------------------------------------------------------------------------

def _read_torch_dist(directory: Path, names: set[str] | None) -> MegatronCheckpoint:
    # Here, not at the top: torch.distributed.checkpoint costs every process seconds to import.
    from megalite.megatron_checkpoint import torch_dist
    state, common = torch_dist.read(directory, names)
    args = _field(common, "args", directory)
    config = layout.config_from_args(args, str(directory))
    if config.num_experts and not all(config.moe_layer_pattern):
        # Such a tensor is stacked over all layers with rows only for its kind of layer.
        raise CheckpointError(f"torch_dist checkpoint {directory} mixes dense and MoE layers "
                              f"(moe_layer_freq={args.moe_layer_freq!r}), whose partly stored "
                              f"stacked tensors megalite does not read: save it with "
                              f"--ckpt-format torch")
    layout.check_state(state, config, str(directory), names)
    return MegatronCheckpoint(directory, "torch_dist", int(common.get("iteration", 0)), args,
                              config, state, {k: v for k, v in common.items() if k != "args"})
