"""Which layout to train a model with (issue 25; docs/design.md §13): the candidate layouts
at a world size, the messages each sends per step, and the estimate that prunes them before
tools/check_cluster.py times the survivors. The cluster check measures bus bandwidth at the
sizes `step_traffic` lists, so it measures what the layouts send.

The estimate of one step on one rank is

    compute x (1 + (p - 1) / (v m)) x r  +  sum over messages: count x size x f(n) / busbw

with `compute` the rank's share of the model's FLOPs (num_floating_point_operations / world)
at the FLOP rate measured on the default layout, the pipeline bubble of p stages, v virtual
stages and m micro-batches (Narayanan et al. 2021, §2.2), r = 4/3 under full recompute (one
more forward), and nccl-tests' bus bandwidth turned back into seconds with the algorithm
factor f(n) of the group of n ranks that sends the message (2(n-1)/n all-reduce, (n-1)/n
all-gather and reduce-scatter, 1 p2p). No overlap is assumed: communication is an upper
bound, so the rule that drops a layout whose communication alone exceeds the best layout's
whole step never drops one that could win.
"""

import math
from dataclasses import dataclass

import torch

from megalite.arguments import parse_args
from megalite.config import Config, OptimizerKind
from megalite.context_parallel.attention import cp_comm_bytes
from megalite.distributed.fsdp import ZERO3, fsdp_units
from megalite.distributed.hybrid_bytes import algorithm_factor
from megalite.errors import ConfigError
from megalite.layout_check import SHARDING, axes_name, grid_flags, grids
from megalite.memory_estimate import most_loaded_rank
from megalite.memory_estimate.weights import grad_buckets, rank_parameters, shard_numel
from megalite.model.gpt import activation_shape, build_model_chunks
from megalite.training_log import num_floating_point_operations
from megalite.validation import validate_args


@dataclass(frozen=True)
class Message:
    what: str
    op: str
    size: int
    """Bytes per message."""
    count: float
    """Messages per step on the most loaded rank."""
    group: int


def step_traffic(config: Config) -> list[Message]:
    """The collectives one rank of pipeline stage 0 sends in a training step of `config`."""
    par, m = config.parallel, config.training.num_microbatches
    tp, pp, cp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                  par.context_parallel_size)
    v = par.virtual_pipeline_model_parallel_size or 1
    act = math.prod(activation_shape(config.model, config.training.micro_batch_size, 1, cp))
    act *= config.precision.params_bytes
    layers = config.model.num_layers // pp  # on one rank, over its v chunks
    full = config.model.recompute_granularity == "full"
    out = _data_parallel_traffic(config)
    if tp > 1:  # f and g: 2 all-reduces forward, 2 backward, per layer (Shoeybi §3); under
        # SP each is an all-gather + reduce-scatter pair, the same bus time
        out.append(Message("TP activations", "all-reduce", act, layers * m * (6 if full else 4),
                           tp))
    if pp > 1:  # an activation forward, its gradient backward, per micro-batch and chunk
        size = act // (tp if config.model.sequence_parallel else 1)
        out.append(Message("PP activations", "p2p", size, 2 * m * v, 2))
    if cp > 1:
        model = config.model
        kv = cp_comm_bytes(model.cp_comm_type, cp_size=cp, batch=config.training.micro_batch_size,
                           seq_length=model.seq_length, kv_heads=model.num_query_groups // tp,
                           head_dim=model.kv_channels, element_size=config.precision.params_bytes)
        per_step = (kv.total + (kv.forward if full else 0)) * layers * m
        size = kv.forward // (2 * (cp - 1))  # one K or V chunk
        out.append(Message(f"CP K/V ({model.cp_comm_type})", "p2p", size, per_step / size, cp))
    return out


def _data_parallel_traffic(config: Config) -> list[Message]:
    """Gradient reduction and parameter gathers over DP x CP: the buckets (all-reduce, or
    ZeRO-1's reduce-scatter + all-gather), or FSDP2's units (all-gathered once per forward
    and, resharded after it, again in backward; gradients reduce-scattered). Under hybrid
    sharding (N replicas) the sharded ones stay within a shard group of DP x CP / N ranks
    and each rank's gradient shard is all-reduced across the replicas
    (distributed/hybrid_bytes.py's closed forms)."""
    grid = config.parallel.grid
    if grid.dp_cp_size == 1:
        return []
    kind, pbytes, gbytes = config.optimizer_kind, config.precision.params_bytes, config.grad_bytes
    if kind is OptimizerKind.FULLY_SHARDED:
        par = config.parallel
        with torch.device("meta"):
            chunks = build_model_chunks(config.model, 0, 0, par.pipeline_model_parallel_size,
                                        par.virtual_pipeline_model_parallel_size or 1,
                                        layer_counts=par.pipeline_layer_counts)
        units = [_unit_numels(config, chunk) for chunk in chunks]
        unit, count = max(max(u) for u in units), sum(len(u) for u in units)
        gathers = 2 if par.data_parallel_sharding_strategy == ZERO3 else 1
        return _sharded([Message("FSDP2 unit gather", "all-gather", unit * pbytes,
                                 gathers * count, grid.shard_size),
                         Message("FSDP2 unit gradients", "reduce-scatter", unit * gbytes,
                                 count, grid.shard_size)], "FSDP2 unit", unit, count, config)
    buckets = grad_buckets(config, rank_parameters(config, 0))
    size = max(padded for _, padded in buckets)
    if not kind.sharded:
        return [Message("DP gradient buckets", "all-reduce", size * gbytes, len(buckets),
                        grid.dp_cp_size)]
    return _sharded([Message("ZeRO-1 gradient buckets", "reduce-scatter", size * gbytes,
                             len(buckets), grid.shard_size),
                     Message("ZeRO-1 parameter gather", "all-gather", size * pbytes,
                             len(buckets), grid.shard_size)], "ZeRO-1 bucket", size,
                    len(buckets), config)


def _sharded(within: list[Message], what: str, numel: int, count: int,
             config: Config) -> list[Message]:
    """A sharded optimizer's messages within its shard group (none if that is one rank),
    and across N > 1 replicas the all-reduce of each `numel`-element message's shard."""
    grid = config.parallel.grid
    s, n = grid.shard_size, grid.num_distributed_optimizer_instances
    out = within if s > 1 else []
    if n > 1:
        out.append(Message(f"{what} gradient shards across replicas", "all-reduce",
                           -(-numel // s) * config.grad_bytes, count, n))
    return out


def _unit_numels(config: Config, chunk) -> list[int]:
    """Elements (of a TP shard) of each FSDP2 unit of a chunk: the root (what no unit
    holds: a tied embedding, the final norm) and fsdp_units'."""
    units = [list(u.parameters()) for u in fsdp_units(chunk)]
    held = {id(p) for u in units for p in u}
    units.append([p for p in chunk.parameters() if id(p) not in held])
    return [sum(shard_numel(config, p) for p in u) for u in units]


# ------------------------------------------------------------------ candidates

@dataclass(frozen=True)
class Candidate:
    name: str
    flags: tuple[str, ...]
    config: Config


RECOMPUTE = {"": (), " selective": ("--recompute-granularity", "selective"),
             " full": ("--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "1")}


def hybrid_sharding(nodes: int, dp_cp: int) -> dict[str, tuple[str, ...]]:
    """SHARDING, and on more than one node each sharded optimizer over N = `nodes` replicas
    (--num-distributed-optimizer-instances = nodes, when a shard group keeps >= 2 ranks)."""
    if nodes == 1 or dp_cp % nodes or dp_cp // nodes < 2:
        return SHARDING
    replicas = ("--num-distributed-optimizer-instances", str(nodes))
    return {**SHARDING, **{f"{name.replace(' FSDP2', ' HSDP')} N {nodes}": (*flags, *replicas)
                           for name, flags in SHARDING.items() if name}}


def candidates(model: list[str], world: int, global_batch: int, fits,
               micro_batches=(1, 2, 4), max_degree: int = 4,
               nodes: int = 1) -> tuple[list[Candidate], int]:
    """The layouts of `model` (pretrain_gpt.py flags) at `world` ranks on `nodes` nodes that
    validate_args accepts and `fits(config)` says fit: TP (with SP), PP with 1 or 2 virtual
    stages, CP, DP over the rest, each sharding (plain DP, ZeRO-1, FSDP2 in both strategies;
    past one node also each sharded one over N = `nodes` replicas) and micro-batch size, each
    with the least recompute (none, selective, full) that fits: recompute only buys memory
    with compute. And how many layouts validate_args took."""
    num_layers = parse_args(model).num_layers
    out, valid = [], 0
    for tp, pp, cp, dp in grids(world, max_degree):
        for vp in (1, 2) if pp > 1 and num_layers % (2 * pp) == 0 else (1,):
            grid = grid_flags(tp, pp, cp, num_layers // (pp * vp) if vp > 1 else None)
            where = axes_name(("TP", tp), ("PP", pp), ("CP", cp)) + (f" (v{vp})" if vp > 1 else "")
            where = " x ".join(filter(None, [where, axes_name(("DP", dp))]))
            for shard, shard_flags in hybrid_sharding(nodes, dp * cp).items():
                if shard and dp * cp == 1:
                    continue  # nothing to shard over
                for micro in micro_batches:
                    flags = ["--micro-batch-size", str(micro), "--global-batch-size",
                             str(global_batch), *grid, *shard_flags]
                    found, took = _least_recompute(model, flags, world, fits)
                    valid += took
                    if found:
                        recompute, config, extra = found
                        out.append(Candidate(f"{where or '1 rank'}{shard}{recompute}, "
                                             f"micro-batch {micro}", tuple(flags + extra),
                                             config))
    return out, valid


def _least_recompute(model, flags, world, fits):
    """((name, config, flags) of the least recompute with which `flags` fit, or None;
    whether validate_args took the layout at all)."""
    took = False
    for recompute, extra in RECOMPUTE.items():
        try:
            config = validate_args(parse_args(model + flags + list(extra)), world)
        except ConfigError:
            continue
        took = True
        if fits(config):
            return (recompute, config, list(extra)), took
    return None, took


def planned_bytes(config: Config, device: str) -> int:
    return most_loaded_rank(config, device).total


# ------------------------------------------------------------------ the estimate

def communication_seconds(config: Config, busbw) -> float:
    """Seconds of one step's messages at `busbw(op, size)` GB/s."""
    return sum(msg.count * msg.size * algorithm_factor(msg.op, msg.group)
               / (busbw(msg.op, msg.size) * 1e9) for msg in step_traffic(config))


def compute_seconds(config: Config, world: int, flops_per_second: float) -> float:
    """The rank's share of the step's FLOPs at `flops_per_second`, with the bubble and
    recompute."""
    par, m = config.parallel, config.training.num_microbatches
    p, v = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    flops = num_floating_point_operations(config.model, config.training.global_batch_size)
    recompute = 4 / 3 if config.model.recompute_granularity == "full" else 1.0
    return flops / world / flops_per_second * (1 + (p - 1) / (v * m)) * recompute


@dataclass
class Estimate:
    candidate: Candidate
    compute: float
    communication: float

    @property
    def step(self) -> float:
        return self.compute + self.communication


def prune_by_bandwidth(estimates: list[Estimate]) -> tuple[list[Estimate], list[Estimate]]:
    """(kept, dropped): a layout whose communication alone takes longer than the best
    layout's whole step cannot win, even with every message overlapped with compute."""
    best = min(e.step for e in estimates)
    # Ties (the estimate does not see how fast a larger micro-batch multiplies) go to the
    # larger micro-batch.
    kept = sorted((e for e in estimates if e.communication <= best),
                  key=lambda e: (round(e.step, 6), -e.candidate.config.training.micro_batch_size))
    return kept, [e for e in estimates if e.communication > best]


def nearest_bandwidth(measured: dict[tuple[str, int], float]):
    """busbw(op, size): the measured GB/s of `op` at the measured size nearest `size` (in
    log scale)."""
    def busbw(op: str, size: int) -> float:
        sizes = [s for o, s in measured if o == op]
        nearest = min(sizes, key=lambda s: abs(math.log(s / max(size, 1))))
        return measured[op, nearest]
    return busbw
