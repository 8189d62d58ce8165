"""Sharded checkpoints: what each rank writes (docs/design.md §8); loading.py reads them back.

Files of `iter_0000100/` (made visible atomically by storage.py):
  model_tp{t}_pp{p}.pt      DP and CP rank 0 of each (TP, PP) pair: {"params": name -> this TP
                            shard, "partition_dims": name -> dim of the TP split,
                            "partition_strides": name -> blocks of a stacked one}
  optim_tp{t}_pp{p}_dp{d}.pt  each DP x CP rank d whose optimizer owns state (all of them
                            under ZeRO-1, which shards over DP x CP; rank 0 otherwise):
                            {"step": Adam's step count,
                            "segments": name -> {"range": [start, end) of the flattened TP
                            shard, "main", "exp_avg", "exp_avg_sq"}}
  rng_rank{r}.pt            every rank: python, numpy, torch, the run's device kind, its
                            generator and the TP tracker's states
  metadata.json             layout, model config, iteration, consumed samples, LR
                            scheduler and loss scaler state, versions, the config, the
                            launch that wrote it ("run": save_guard.RunRecord)
Names are the single-process model's (megalite/model/gpt.py keys layers by global index),
and the last stage's copy of a tied embedding is not saved: it is the embedding.

Expert parallelism changes none of the files: an expert parameter is saved with all its
experts (gathered over the EP group: every rank takes part), and an optimizer segment of
one records its range in the flattened all-experts tensor (an EP rank's experts are a
contiguous block of it), so the files read the same whatever EP wrote them. Without ZeRO-1
the experts' main copies and moments are gathered over EP like the parameters.
"""

import dataclasses
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

import megalite
from megalite.checkpointing import remote
from megalite.checkpointing.compression_state import compression_file, compression_record
from megalite.checkpointing.save_guard import RunRecord, newer_tracked
from megalite.checkpointing.state import (CheckpointState, cpu_copy, layout_of, saved_params,
                                          state_buffers)
from megalite.checkpointing.model_fields import (MLA_MODEL_FIELDS, MOE_FIELDS, RECORDED_FIELDS,
                                                 RECORDED_WHEN_SET)
from megalite.checkpointing.storage import (apply_retention, checkpoint_dir, commit,
                                           prepare_staging, save_tensor_file, staging_dir)
from megalite.distributed.fsdp import full_tensor, is_fully_sharded
from megalite.errors import StorageError
from megalite.parallel_state import RankGrid, all_gather_first_dim, group_rank
from megalite.tensor_parallel.params import (is_embedding_copy, is_expert_parallel,
                                             partition_dim, partition_stride)

FORMAT_VERSION = 1


def model_file(tp: int, pp: int) -> str:
    return f"model_tp{tp:02d}_pp{pp:03d}.pt"


def optim_file(tp: int, pp: int, dp: int) -> str:
    return f"optim_tp{tp:02d}_pp{pp:03d}_dp{dp:03d}.pt"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def shard_layout(params: dict[str, nn.Parameter]) -> dict:
    """How the TP shards of a model file join into full tensors: the partition dim of each
    split parameter, and the stride of each stacked one (params.mark_stacked; files
    without "partition_strides" predate them and hold none)."""
    return {"partition_dims": {n: partition_dim(p) for n, p in params.items()
                               if partition_dim(p) is not None},
            "partition_strides": {n: partition_stride(p) for n, p in params.items()
                                  if partition_stride(p) > 1}}


SINGLE_PROCESS_LAYOUT = layout_of(RankGrid(1), 1, zero=False)
"""What a one-process run records: the layout of the checkpoints the converters write."""


def saved_layout(layout: dict) -> dict:
    """A checkpoint's layout with the defaults of keys added since (checkpoints written
    before context parallelism are CP 1, before expert parallelism EP 1)."""
    return {"context_parallel_size": 1, "expert_model_parallel_size": 1, **layout}


def optimizer_shards(layout: dict) -> int:
    """How many optim files per (TP, PP) shard: one per DP x CP rank of one replica under
    ZeRO-1 and FSDP2 (all of DP x CP with one replica; every replica holds the same)."""
    layout = saved_layout(layout)
    if not layout["use_distributed_optimizer"]:
        return 1
    return (layout["data_parallel_size"] * layout["context_parallel_size"]
            // layout.get("num_distributed_optimizer_instances", 1))


def expected_files(layout: dict, save_optim: bool, save_rng: bool = True) -> list[str]:
    tp, pp = layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]
    dps = range(optimizer_shards(layout))
    files = [model_file(t, p) for t in range(tp) for p in range(pp)]
    if save_optim:
        files += [optim_file(t, p, d) for t in range(tp) for p in range(pp) for d in dps]
    if save_rng:
        files += [rng_file(r) for r in range(layout["world_size"])]
    return files


# --- saving --------------------------------------------------------------------------------

def save_checkpoint(save: str, iteration: int, ckpt: CheckpointState,
                    writing: Callable = nullcontext) -> Path | str:
    """Every rank calls this at the same iteration; returns the published directory (a URL
    in a bucket). async_save.py writes the same `rank_files` from a background thread.
    `writing()`: the context of the file writes and uploads alone (the watchdog suspended)."""
    staging = begin_save(save, iteration, ckpt.config)
    files = rank_files(ckpt)
    with writing():
        for name, obj in files.items():
            save_tensor_file(obj, staging / name)
        if remote.is_remote(save):
            try:
                records, error = remote.upload(save, iteration, staging, list(files)), None
            except StorageError as failure:
                records, error = None, str(failure)
    uploads = None
    if remote.is_remote(save):  # every rank's upload, or an error on every rank
        uploads = remote.gather_uploads(records, error)
    else:
        dist.barrier()
    if dist.get_rank() == 0:
        publish(save, iteration, checkpoint_metadata(ckpt), ckpt.config, uploads)
    dist.barrier()
    return checkpoint_location(save, iteration)


def checkpoint_location(save: str, iteration: int) -> Path | str:
    """The directory (or, in a bucket, the URL) of `save`'s checkpoint of `iteration`."""
    if remote.is_remote(save):
        return f"{save.rstrip('/')}/{checkpoint_dir('', iteration).name}"
    return checkpoint_dir(save, iteration)


def begin_save(save: str, iteration: int, config) -> Path:
    """Every rank: rank 0 empties the staging directory (in a bucket: also what a crashed
    save of `iteration` left there), then all may write into it."""
    if remote.is_remote(save):
        staging = remote.local_staging(save, iteration, remote.cache_of(config))
        if dist.get_rank() == 0:
            remote.begin(save, iteration, remote.cache_of(config))
        dist.barrier()
        staging.mkdir(parents=True, exist_ok=True)  # another node's
        return staging
    if dist.get_rank() == 0:
        prepare_staging(save, iteration)
    dist.barrier()
    return staging_dir(save, iteration)


def rank_files(ckpt: CheckpointState, copy: Callable = cpu_copy) -> dict[str, dict]:
    """file name -> what this rank writes into it, every tensor a host copy made by
    `copy(tensor, dtype)` (default: a fresh CPU tensor; --async-save's is made later, but
    before the next optimizer step). Every rank calls it at once: under FSDP2 each whole
    value is gathered."""
    optimizer, state = ckpt.optimizer, ckpt.parallel
    optimizer.finish_param_gather()
    params = saved_params(ckpt.chunks)
    owns_model_file = state.dp_rank == 0 and state.cp_rank == 0
    files = {}
    # Every EP rank takes part in gathering the experts (each rank's block is dim 0's,
    # in EP rank order; under FSDP2 each EP block gathered over expert-DP first).
    experts = {n: all_gather_first_dim(full_tensor(p.detach()), state.ep_group)
               for n, p in params.items() if state.ep_size > 1 and is_expert_parallel(p)}
    if owns_model_file or is_fully_sharded(ckpt.chunks):
        values = _model_values(params, experts, state_buffers(ckpt.chunks, chunk_prefix=False),
                               copy if owns_model_file else None)
    if owns_model_file:
        files[model_file(state.tp_rank, state.pp_rank)] = {"params": values,
                                                           **shard_layout(params)}
    if ckpt.config.checkpoint.save_optim:
        names = {id(p): n for n, p in params.items()}
        # Sharded, the first replica's ranks write their shards (the others hold the same).
        write = state.replica_rank == 0 if optimizer.sharded else owns_model_file
        shard = _optimizer_shard(ckpt, names, copy, write=write)
        if write:
            # ZeRO-1's shard index: this rank's place in its shard group (DP x CP).
            files[optim_file(state.tp_rank, state.pp_rank,
                              group_rank(state.shard_group))] = shard
    files[rng_file(dist.get_rank())] = ckpt.rng_state()
    if ckpt.compressor is not None:
        # Copied now, not by `copy`: --async-save's copies wait for the next optimizer
        # step, and the next step's gradient reduction changes the error and Q before it.
        files[compression_file(dist.get_rank())] = compression_record(ckpt.compressor,
                                                                      ckpt.layout, cpu_copy)
    return files


def _model_values(params: dict, experts: dict, buffers: dict, copy: Callable | None) -> dict:
    """Each parameter's whole (TP-shard) value copied by `copy`. Under FSDP2 every DP rank
    takes part in the gathers; only the model file's writer (`copy` given) keeps them."""
    values = {}
    for n, p in params.items():
        value = experts[n] if n in experts else full_tensor(p.detach())
        if copy is None:
            continue
        # A buffer moves outside AdamW's step (a router's expert bias, in the gradient
        # finalisation), before --async-save's copies must be done: copied on the device
        # now, this iteration's value.
        if n in buffers:
            value = value.clone()  # gpu_check: save_paths
        # Copies on the host: a parameter may be a view into a flat buffer (ZeRO-1), and
        # torch.save would write the whole buffer.
        values[n] = copy(value)
    return values


def checkpoint_metadata(ckpt: CheckpointState) -> dict:
    """What rank 0 records in metadata.json, as of now (taken when the save starts)."""
    config = ckpt.config
    return {"format_version": FORMAT_VERSION, "megalite_version": megalite.__version__,
            "torch_version": torch.__version__, "layout": ckpt.layout,
            "model": model_fields(config.model), "has_optimizer": config.checkpoint.save_optim,
            "has_rng": True, **ckpt.position(), "scheduler": ckpt.scheduler.state_dict(),
            "grad_scaler": ckpt.grad_scaler_state(),
            # What JSON cannot hold (dtypes, enums) as its str().
            "config": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
            "run_file": ckpt.run_file, "run": dataclasses.asdict(ckpt.progress.run)}


def publish(save: str, iteration: int, metadata: dict, config,
            uploads: dict | None = None) -> None:
    """Rank 0, once every rank's files are in the staging directory (in a bucket: uploaded,
    `uploads` their records): commit, retention, both leaving alone the checkpoints of
    another run (save_guard.py)."""
    newer = newer_tracked(save, iteration)
    expected = expected_files(metadata["layout"], config.checkpoint.save_optim)
    run = RunRecord.of(metadata)
    owns, keep = (run.owns if run else None), config.checkpoint.keep_last
    if remote.is_remote(save):
        remote.commit(save, iteration, metadata, expected, uploads, newer is None,
                      remote.cache_of(config))
    else:
        commit(save, iteration, metadata, expected, track=newer is None)
    if newer is not None:
        print(f"  the tracker of {save} still names iteration {newer}, a newer checkpoint "
              f"this run did not write: --load {save} resumes that one", flush=True)
    (remote.apply_retention if remote.is_remote(save) else apply_retention)(save, keep, owns)


def _optimizer_shard(ckpt: CheckpointState, names: dict[int, str], copy: Callable,
                     write: bool) -> dict:
    """This rank's optimizer file (module docstring), built when `write`; every rank calls
    it, as the experts' state of an unsharded optimizer is gathered over EP."""
    optimizer, state = ckpt.optimizer, ckpt.parallel
    segments, step = {}, 0
    for s in optimizer.segments:
        expert = state.ep_size > 1 and is_expert_parallel(s.param)
        gather = expert and not optimizer.sharded  # a whole EP block: gather all experts
        if is_embedding_copy(s.param) or not (write or gather):
            continue
        values, adam = ckpt.adam_state(s)
        if "step" in adam:
            step = int(adam["step"].item())
        # An EP block's place in the flattened all-experts tensor (docstring).
        shift = state.ep_rank * s.param.numel() if expert and not gather else 0
        if gather:
            values = {k: all_gather_first_dim(v.detach().reshape(s.param.shape), state.ep_group)
                      for k, v in values.items()}
        if write:
            entry = {k: copy(v.reshape(-1), torch.float32 if k == "main" else None)
                     for k, v in values.items()}
            end = s.end * state.ep_size if gather else s.end + shift
            segments[names[id(s.param)]] = {"range": torch.tensor([s.start + shift, end]),
                                            **entry}
    return {"step": step, "segments": segments}


def model_fields(model_config) -> dict:
    """The fields of model_fields.RECORDED_FIELDS that `model_config` has (a dense model's
    without the MoE ones, one without multi-latent attention without the MLA ones;
    model_fields.RECORDED_WHEN_SET's only when set)."""
    fields = dataclasses.asdict(model_config)
    dense, mla = not fields.get("num_experts"), fields.get("multi_latent_attention")
    return {f: fields[f] for f in RECORDED_FIELDS
            if f in fields and not (dense and f in MOE_FIELDS)
            and not (not mla and f in MLA_MODEL_FIELDS)
            and not (f in RECORDED_WHEN_SET and not fields[f])}

