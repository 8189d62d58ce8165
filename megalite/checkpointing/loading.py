"""Loading a checkpoint (saving.py's files) into a CheckpointState (state.py): this rank's
model chunks, optimizer, scheduler, RNG and PowerSGD state.

At any (TP, PP, v, DP, CP, EP) layout, no converter: every parameter and each of its optimizer
tensors (fp32 main copy, Adam moments) is reassembled into the full single-process tensor
from the saved shards (TP pieces joined along their partition dim by params.tp_unshard, DP
segments placed at their ranges) and cut again for this rank (its experts, then its TP
shard: CheckpointState.load_params and load_optimizer). Vocabulary padding, which depends on
TP, is zero in weights and Adam moments alike, so it is dropped or added as zeros. Files
are memory-mapped, so a rank reads only the pieces it touches. RNG states only mean
something at the same layout; at another they are left as seeded. The device's own and the
tracker's also need the same kind of device (CheckpointState.load_rng_state).
"""

from pathlib import Path

import torch
import torch.distributed as dist

from megalite.checkpointing import remote
from megalite.checkpointing.compression_state import load_compression_state
from megalite.checkpointing.saving import (model_fields, model_file, optim_file,
                                           optimizer_shards, rng_file, saved_layout)
from megalite.checkpointing.state import CheckpointState
from megalite.checkpointing.model_fields import check_model_compatible
from megalite.checkpointing.storage import find_checkpoint_to_load, load_tensor_file, read_metadata
from megalite.errors import CheckpointError
from megalite.tensor_parallel.params import tp_unshard

# Before SwiGLU's gate and up were fused into linear_fc1 = [gate; up], the gate was saved
# as its own parameter; such checkpoints still load (SavedCheckpoint._with_legacy_gate).
_LEGACY_GATE = "linear_fc1_gate"


class SavedCheckpoint:
    """Full single-process tensors, assembled on demand from a checkpoint's shards."""

    def __init__(self, directory: Path, metadata: dict):
        self.directory, self.layout = directory, metadata["layout"]
        self.tp = self.layout["tensor_model_parallel_size"]
        self.dps = range(optimizer_shards(self.layout))
        self._files: dict[str, dict] = {}
        self.stage_of = {name: pp for pp in range(self.layout["pipeline_model_parallel_size"])
                         for name in self._file(model_file(0, pp))["params"]}

    def _file(self, name: str) -> dict:
        if name not in self._files:
            self._files[name] = load_tensor_file(self.directory / name, mmap=True)
        return self._files[name]

    def _stage(self, name: str) -> int:
        if name not in self.stage_of:
            raise CheckpointError(f"checkpoint {self.directory} has no parameter {name}")
        return self.stage_of[name]

    @property
    def names(self) -> list[str]:
        """The single-process parameter names this checkpoint gives values for."""
        return [n for n in self.stage_of if _LEGACY_GATE not in n]

    def param(self, name: str) -> torch.Tensor:
        return self._with_legacy_gate(name, None)

    def optimizer_tensor(self, name: str, key: str) -> torch.Tensor:
        """The full fp32 tensor `key` ("main", "exp_avg" or "exp_avg_sq") of `name`."""
        return self._with_legacy_gate(name, key)

    def _with_legacy_gate(self, name: str, key: str | None) -> torch.Tensor:
        """`_full(name, key)`; of a SwiGLU checkpoint saved before gate and up were fused
        into linear_fc1 (transformer.MLP), its separate gate stacked on top: [gate; up]."""
        gate = name.replace("mlp.linear_fc1.", f"mlp.{_LEGACY_GATE}.")
        if gate != name and gate in self.stage_of:
            return torch.cat([self._full(gate, key), self._full(name, key)])
        return self._full(name, key)

    def _full(self, name: str, key: str | None) -> torch.Tensor:
        """The parameter `name` (`key` None) or its optimizer tensor `key`, its TP shards
        joined."""
        files = [self._file(model_file(t, self._stage(name))) for t in range(self.tp)]
        shards = [f["params"][name] if key is None else
                  self._optimizer_shard(name, key, t, f["params"][name].shape)
                  for t, f in enumerate(files)]
        return tp_unshard(shards, files[0]["partition_dims"].get(name),
                          files[0].get("partition_strides", {}).get(name, 1))

    def _optimizer_shard(self, name: str, key: str, tp: int, shape) -> torch.Tensor:
        """`key` of TP shard `tp` of `name`, its DP segments placed at their ranges."""
        if len(self.dps) == 1:  # the same layout (no ZeRO-1): no assembly, no copy
            segment = self._file(optim_file(tp, self._stage(name), 0))["segments"].get(name)
            if segment is not None and key in segment and \
                    segment["range"].tolist() == [0, shape.numel()]:
                return segment[key].view(shape)
        flat, covered = torch.zeros(shape.numel()), 0
        for d in self.dps:
            filename = optim_file(tp, self._stage(name), d)
            segment = self._file(filename)["segments"].get(name)
            if segment is None:
                continue
            if key not in segment:
                raise CheckpointError(f"{self.directory / filename} has no {key} for "
                                      f"{name} (saved before the first optimizer step?)")
            start, end = segment["range"].tolist()
            flat[start:end] = segment[key]
            covered += end - start
        if covered != flat.numel():
            raise CheckpointError(f"checkpoint {self.directory}: the optimizer state of "
                                  f"{name} (TP shard {tp}) covers {covered} of "
                                  f"{flat.numel()} elements")
        return flat.view(shape)

    def optimizer_step(self) -> int:
        return int(self._file(optim_file(0, 0, 0))["step"])


def load_checkpoint(load: str, ckpt: CheckpointState) -> dict | None:
    """Restore everything a checkpoint holds that the flags ask for into `ckpt`. Returns
    the iteration and consumed samples to continue from, or None when `load` holds no
    checkpoint at all (a fresh start)."""
    # A bucket's is downloaded into the node's cache, then loaded from there.
    local = (remote.fetch_for_ranks(load, remote.cache_of(ckpt.config))
             if remote.is_remote(load) else load)
    found = find_checkpoint_to_load(local) if local is not None else None
    flags = ckpt.config.checkpoint
    if found is None:
        if flags.finetune:
            raise CheckpointError(f"--finetune: no checkpoint in --load {load}")
        return None
    iteration, directory = found
    meta = read_metadata(directory)
    check_model_compatible(meta["model"], model_fields(ckpt.config.model), checkpoint=directory)
    saved = SavedCheckpoint(directory, meta)
    ckpt.load_params(saved.param)
    if flags.load_optim and not flags.finetune:
        if meta["has_optimizer"]:
            ckpt.load_optimizer(saved.optimizer_step(), saved.optimizer_tensor)
            ckpt.load_grad_scaler_state(meta["grad_scaler"])
        elif dist.get_rank() == 0:
            print(f" > {directory} holds no optimizer state (saved with --no-save-optim): "
                  "Adam starts afresh", flush=True)
    if flags.finetune:
        return {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0}
    ckpt.scheduler.load_state_dict(meta["scheduler"])
    if flags.load_rng and meta.get("has_rng", True):
        if saved_layout(meta["layout"]) == ckpt.layout:
            ckpt.load_rng_state(load_tensor_file(directory / rng_file(dist.get_rank())))
        elif dist.get_rank() == 0:
            print(f" > not restoring RNG states: saved at layout {meta['layout']}, running "
                  f"at {ckpt.layout}", flush=True)
    if ckpt.compressor is not None:
        load_compression_state(directory, ckpt.compressor, ckpt.layout,
                               next(ckpt.chunks.parameters()).device)
    return {"iteration": iteration, **{k: meta[k] for k in ("consumed_train_samples",
                                                            "consumed_valid_samples")}}
