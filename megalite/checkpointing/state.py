"""What a checkpoint holds (docs/design.md §8): one object, `CheckpointState`, with
everything a resume needs: the model chunks (and their persistent buffers: a MoE router's
expert bias), the optimizer (fp32 main copies, Adam's moments and step, the loss scaler),
the LR scheduler, the RNG states (the host's, the device's, the TP tracker's), the run's
position (`TrainState`), PowerSGD's state and the run's record and flags.

The saves and the load walk it: saving.py writes its files, async_save.py the same files
from a background thread, local.py its `state_dict` (this rank's own values, at its own
layout), and loading.py sets it from any layout's files through `load_params` and
`load_optimizer` (megatron_checkpoint/load.py too, from Megatron's)."""

import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from megalite.checkpointing.save_guard import RunRecord
from megalite.distributed.fsdp import copy_into, full_tensor
from megalite.parallel_state import ParallelState, RankGrid, print_rank_0
from megalite.tensor_parallel.params import (ep_shard, is_embedding_copy, local_shard,
                                             single_process_name)
from megalite.tensor_parallel.random import get_device_rng_state, set_device_rng_state

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class TrainState:
    """Where the run stands: the iterations done and the samples consumed."""
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    run: RunRecord = field(default_factory=RunRecord)
    """This launch, as its checkpoints record it (save_guard.py)."""


def canonical_name(name: str, param: nn.Parameter) -> str:
    """Chunk parameters are "<chunk>.<single-process name>"; a tied output layer on the
    last stage is a copy of the word embeddings."""
    return single_process_name(name.split(".", 1)[1], param)


def saved_params(chunks: nn.ModuleList) -> dict[str, nn.Parameter]:
    """The parameters, and the buffers that are model state (a MoE router's expert bias),
    by single-process name."""
    params = {canonical_name(n, p): p for n, p in chunks.named_parameters()
              if not is_embedding_copy(p)}
    return {**params, **state_buffers(chunks, chunk_prefix=False)}


def state_buffers(chunks: nn.ModuleList, chunk_prefix: bool = True) -> dict[str, torch.Tensor]:
    """The persistent buffers of `chunks` (those a state_dict holds; masks and per-step
    counters are not persistent), by name with or without the "<chunk>." prefix."""
    out = {}
    for module_name, module in chunks.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                full = f"{module_name}.{name}"
                out[full if chunk_prefix else full.split(".", 1)[1]] = buffer
    return out


def layout_of(grid: RankGrid, num_chunks: int, zero: bool) -> dict:
    """The layout a checkpoint records: the grid, model chunks per rank, ZeRO-1 or not, and
    the replicas of hybrid sharding when there are several."""
    return {"tensor_model_parallel_size": grid.tensor_model_parallel_size,
            "pipeline_model_parallel_size": grid.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": num_chunks,
            "data_parallel_size": grid.data_parallel_size, "world_size": grid.world_size,
            "use_distributed_optimizer": zero,
            "context_parallel_size": grid.context_parallel_size,
            "expert_model_parallel_size": grid.expert_model_parallel_size,
            # Only when hybrid sharding: a layout of one replica reads as it did before.
            **({"num_distributed_optimizer_instances": grid.num_distributed_optimizer_instances}
               if grid.num_distributed_optimizer_instances > 1 else {})}


def cpu_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return tensor.detach().to("cpu", dtype=dtype, copy=True)


@dataclass
class CheckpointState:
    """This rank's part of everything a resume needs. `config`: the run's Config (what
    config.checkpoint saves and loads; the model's fields); `compressor`: the gradient
    buffer's PowerSGD; `run_file`: the run's flags as YAML (megalite/run_file.py)."""
    chunks: nn.ModuleList
    optimizer: object
    scheduler: object
    parallel: ParallelState
    config: object
    progress: TrainState = field(default_factory=TrainState)
    rng_tracker: object = None
    compressor: object = None
    run_file: str | None = None

    @property
    def layout(self) -> dict:
        return layout_of(self.parallel.grid, len(self.chunks), self.optimizer.sharded)

    def adam_state(self, segment) -> tuple[dict, dict]:
        """A segment's fp32 main copy and the Adam moments it has, and Adam's state."""
        adam = self.optimizer.adam.state.get(segment.main, {})
        return {"main": segment.main, **{m: adam[m] for m in MOMENTS if m in adam}}, adam

    def grad_scaler_state(self) -> dict | None:
        scaler = self.optimizer.grad_scaler
        return scaler.state_dict() if scaler is not None else None

    def load_grad_scaler_state(self, saved: dict | None) -> None:
        if self.optimizer.grad_scaler is not None and saved is not None:
            self.optimizer.grad_scaler.load_state_dict(saved)

    def position(self) -> dict:
        return {"consumed_train_samples": self.progress.consumed_train_samples,
                "consumed_valid_samples": self.progress.consumed_valid_samples}

    def own_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's parameters and persistent buffers by their chunk names."""
        return [*self.chunks.named_parameters(), *state_buffers(self.chunks).items()]

    def state_dict(self, iteration: int) -> dict:
        """All of this rank's state by its own names and segments (local.py's file): it
        loads only at this layout. Every rank at once (FSDP2 gathers each parameter)."""
        self.optimizer.finish_param_gather()
        step, segments = 0, []
        for s in self.optimizer.segments:
            values, adam = self.adam_state(s)
            step = int(adam["step"].item()) if "step" in adam else step
            segments.append({k: cpu_copy(v) for k, v in values.items()})
        return {"iteration": iteration, "layout": self.layout,
                "params": {n: cpu_copy(full_tensor(t.detach())) for n, t in self.own_tensors()},
                "optimizer": {"step": step, "segments": segments},
                "rng": self.rng_state(), "scheduler": self.scheduler.state_dict(),
                "grad_scaler": self.grad_scaler_state(), **self.position()}

    @torch.no_grad()
    def load_state_dict(self, record: dict) -> dict:
        """`state_dict`'s record back; returns the position to continue from."""
        for name, tensor in self.own_tensors():
            copy_into(tensor, record["params"][name])
        self.optimizer.reload_main_params()
        opt = record["optimizer"]
        for s, saved in zip(self.optimizer.segments, opt["segments"], strict=True):
            self.restore_segment(s, opt["step"], dict(saved))
        self.load_grad_scaler_state(record["grad_scaler"])
        self.scheduler.load_state_dict(record["scheduler"])
        self.load_rng_state(record["rng"])
        return {k: record[k] for k in ("iteration", "consumed_train_samples",
                                       "consumed_valid_samples")}

    def rank_block(self, full: torch.Tensor, param: nn.Parameter, name: str) -> torch.Tensor:
        """This rank's block of a single-process tensor: its experts (EP), then its TP
        shard."""
        p = self.parallel
        return local_shard(ep_shard(full, param, p.ep_rank, p.ep_size), param, name,
                           p.tp_rank, p.tp_size)

    @torch.no_grad()
    def load_params(self, full) -> None:
        """Every chunk parameter set to this rank's block of `full(name)`, the parameter's
        single-process tensor, and the optimizer's main copies to them."""
        for name, param in self.chunks.named_parameters():
            name = canonical_name(name, param)
            copy_into(param, self.rank_block(full(name), param, name))
        for name, buffer in state_buffers(self.chunks, chunk_prefix=False).items():
            buffer.copy_(full(name))  # whole on every rank (a MoE router's expert bias)
        self.optimizer.reload_main_params()

    @torch.no_grad()
    def load_optimizer(self, step: int, full) -> None:
        """Each segment this rank's optimizer owns: its fp32 main copy and Adam moments cut
        from `full(name, key)`, the single-process tensors, and Adam's `step`."""
        names = {id(p): canonical_name(n, p) for n, p in self.chunks.named_parameters()}
        for s in self.optimizer.segments:
            name = names[id(s.param)]
            self.restore_segment(s, step, {
                k: self.rank_block(full(name, k), s.param, name).reshape(-1)[s.start:s.end]
                for k in ("main", *MOMENTS)})

    def restore_segment(self, segment, step: int, values: dict) -> None:
        """A segment's fp32 main copy and Adam moments (on the main tensor's device) from
        `values` ("main" and the moments saved)."""
        segment.main.copy_(values.pop("main").view_as(segment.main))
        if values:
            self.optimizer.restore_state(segment, step, values)

    def rng_device(self) -> torch.device:
        """The device whose generators an RNG record holds besides the host's: the run's
        (the tracker's), else the accelerator if there is one."""
        if self.rng_tracker is not None:
            return self.rng_tracker.device
        return torch.accelerator.current_accelerator() or torch.device("cpu")

    def rng_state(self) -> dict:
        """The host's generators (python, numpy, torch), and under "device" the kind of
        device whose own generator (under that kind's name, none on a CPU) and tracker
        states follow: a generator state fits only the kind of generator that made it."""
        version, words, gauss = random.getstate()
        np_state = np.random.get_state()
        device = self.rng_device()
        state = {"python": [version, list(words), gauss],
                 "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                           int(np_state[2]), int(np_state[3]), float(np_state[4])],
                 "torch": torch.get_rng_state(), "device": device.type,
                 "tracker": {} if self.rng_tracker is None else self.rng_tracker.get_states()}
        if device.type != "cpu":
            state[device.type] = get_device_rng_state(device)  # gpu_check: checkpoint_resume
        return state

    def load_rng_state(self, state: dict) -> None:
        """The host's generators always; the device's own and the tracker's only when saved
        on this kind of device (a CPU generator state does not fit a GPU's, nor the
        reverse): otherwise they stay as seeded and the run resumes with other dropout
        masks."""
        version, words, gauss = state["python"]
        random.setstate((version, tuple(words), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(state["torch"])
        device = self.rng_device()
        # Records before "device" hold a "cuda" generator when saved on a CUDA machine.
        saved = state.get("device", "cuda" if "cuda" in state else "cpu")
        if saved != device.type:  # gpu_check: save_paths
            print_rank_0(f" > RNG states saved on {saved}, running on {device.type}: "
                         f"restoring the host's generators (python, numpy, torch) only; the "
                         f"others stay as seeded")
            return
        if saved in state:
            set_device_rng_state(state[saved], device)  # gpu_check: checkpoint_resume
        if self.rng_tracker is not None and state["tracker"]:
            self.rng_tracker.set_states(state["tracker"])
