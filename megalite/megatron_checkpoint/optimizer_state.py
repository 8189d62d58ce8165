"""Megatron's Adam state, where it maps one to one onto megalite's (legacy format only).

A legacy checkpoint saved without --use-distributed-optimizer holds, in each
mp_rank_* file, `optimizer`: the state_dict of Megatron's FP32Optimizer (torch Adam's own
state_dict) or Float16OptimizerWithFloat16Params ({"optimizer": Adam's, "fp32_from_fp16_params":
the fp32 main copies per param group}). Adam numbers that rank's parameters in param-group
order, and Megatron's groups (megatron/core/optimizer/__init__.py, _get_param_groups) are
built from model.named_parameters(): weight-decayed parameters and the rest (biases and
1-D parameters), each group in the order its first parameter appears. Those indices are
mapped back to names here and the TP shards merged like the weights. Anything else (the
distributed optimizer's distrib_optim.pt, torch_dist's optimizer entries, groups that do not
match) is reported with its reason, and the optimizer starts fresh.
"""

from dataclasses import dataclass

import torch

from megalite.checkpointing.state import MOMENTS
from megalite.megatron_checkpoint import layout
from megalite.tensor_parallel.params import partition_dim, partition_stride, tp_unshard


@dataclass
class AdamState:
    step: int
    tensors: dict[str, dict[str, torch.Tensor]]
    """name -> {"main", "exp_avg", "exp_avg_sq"}: full single-process fp32 tensors."""


def megatron_param_groups(names: list[str], shapes: dict[str, torch.Size]) -> list[list[str]]:
    """Megatron's default grouping: decayed first-seen order, no decay for biases and 1-D."""
    groups: dict[bool, list[str]] = {}
    for name in names:
        no_wd = name.endswith(".bias") or len(shapes[name]) == 1
        groups.setdefault(no_wd, []).append(name)
    return list(groups.values())


class _NotOneToOne(Exception):
    """Why a rank's optimizer state does not map onto megalite's."""


def _rank_state(names: list[str], shapes: dict, record) -> tuple[dict, int]:
    """{name: {"main"?, moments}} and Adam's step of one rank's `optimizer` entry."""
    if isinstance(record, list) and len(record) == 1:  # a ChainedOptimizer of one
        record = record[0]
    if not isinstance(record, dict):
        raise _NotOneToOne("its optimizer state has an unknown structure")
    adam = record.get("optimizer", record)
    mains = record.get("fp32_from_fp16_params")
    if not isinstance(adam, dict) or "state" not in adam or "param_groups" not in adam:
        raise _NotOneToOne("its optimizer state is not a torch Adam state_dict")
    groups = megatron_param_groups(names, shapes)
    saved = [g["params"] for g in adam["param_groups"]]
    if [len(g) for g in saved] != [len(g) for g in groups]:
        raise _NotOneToOne(f"its optimizer's param groups ({[len(g) for g in saved]} "
                           f"parameters) are not Megatron's default grouping of the model "
                           f"({[len(g) for g in groups]})")
    out, step = {}, None
    for gi, (ids, group_names) in enumerate(zip(saved, groups)):
        for pi, (index, name) in enumerate(zip(ids, group_names)):
            entry = adam["state"].get(index, {})
            if not all(m in entry for m in MOMENTS):
                raise _NotOneToOne(f"its Adam state has no moments for {name}")
            if entry["exp_avg"].shape != shapes[name]:
                raise _NotOneToOne(f"its Adam state for {name} has shape "
                                   f"{tuple(entry['exp_avg'].shape)}, the parameter "
                                   f"{tuple(shapes[name])}")
            value = entry.get("step", adam["param_groups"][gi].get("step"))
            step = int(value.item() if torch.is_tensor(value) else value or 0)
            out[name] = {m: entry[m].float() for m in MOMENTS}
            if mains is not None:
                out[name]["main"] = mains[gi][pi].float()
    return out, step or 0


def adam_state(ckpt) -> tuple[AdamState | None, str]:
    """Merged Adam state of every rank of a legacy checkpoint (reader's optimizer_shards:
    (tp, pp) -> (names in saved order, shapes, optimizer entry)), or None and why not."""
    if ckpt.ckpt_format != "torch":
        return None, ("the torch_dist format's optimizer state is not read (only the legacy "
                      "format's non-distributed Adam maps one to one)")
    if getattr(ckpt.args, "use_distributed_optimizer", False):
        return None, ("it was saved with --use-distributed-optimizer, whose state "
                      "(distrib_optim.pt) does not map one to one")
    if not ckpt.optimizer_shards:
        return None, "it holds no optimizer state"
    if ckpt.config.num_experts:
        # Megatron groups and numbers each expert's parameters apart; megalite stacks them.
        return None, "the Adam state of a mixture of experts is not mapped"
    per_name: dict[str, list[dict]] = {}
    for (tp, pp), (names, shapes, record) in sorted(ckpt.optimizer_shards.items(),
                                                   key=lambda kv: (kv[0][1], kv[0][0])):
        try:
            state, step = _rank_state(names, shapes, record)
        except _NotOneToOne as why:
            return None, f"mp rank (TP {tp}, PP {pp}): {why}"
        for name, tensors in state.items():
            if pp > 0 and name.startswith("embedding."):
                continue  # the MTP's copy on the last stage (kept equal): the first stage's
            per_name.setdefault(name, []).append(tensors)
    params, merged = layout.meta_params(ckpt.config), {}
    for name, shards in per_name.items():
        if name not in ckpt.state:
            continue  # not read (another stage's), or a tied output layer's copy
        dim, stride = partition_dim(params[name]), partition_stride(params[name])
        merged[name] = {k: tp_unshard([s[k] for s in shards], dim, stride)
                        for k in shards[0]}
        merged[name].setdefault("main", ckpt.state[name].float())
    missing = sorted(set(ckpt.state) - set(merged))
    if missing:
        return None, f"its optimizer state lacks {missing[:3]}"
    return AdamState(step, merged), ""
