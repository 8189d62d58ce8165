"""Collectives: nccl-tests' bus bandwidth of all-reduce, all-gather, reduce-scatter and
paired p2p at the sizes the checked and tuned layouts send (layout_tune.step_traffic) or
--message-sizes, over all ranks and, with several nodes, within a node and across them."""

import socket
import time

import torch
import torch.distributed as dist

from megalite.cluster_check.report import Section, table
from megalite.cluster_check.shared import gathered
from megalite.layout_tune import algorithm_factor, step_traffic
from megalite.parallel_state import all_gather_into, reduce_scatter_into
from megalite.timers import synchronize


def node_groups(world: int) -> tuple[object, list[list[int]], object]:
    """(this node's group, every node's ranks, a group of each node's first rank)."""
    hosts = gathered(socket.gethostname())
    names = list(dict.fromkeys(hosts))
    nodes = [[r for r in range(world) if hosts[r] == h] for h in names]
    groups = [dist.new_group(ranks) for ranks in nodes]  # every rank creates every group
    leaders = dist.new_group([ranks[0] for ranks in nodes])
    return groups[names.index(hosts[dist.get_rank()])], nodes, leaders


def time_collective(fn, device, iters: int = 5) -> float:
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    # The slowest rank sets the pace (on the device: NCCL reduces no host tensor).
    seconds = torch.tensor((time.perf_counter() - start) / iters, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def bus_bandwidths(group, ranks: list[int], size: int, device) -> dict[str, float]:
    """GB/s of nccl-tests' bus bandwidth for `size` bytes over `group` (None: not in it;
    every rank of the launch calls this for the same timings)."""
    n = len(ranks)
    numel = max(size // 4 // n, 1) * n
    x = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    me = dist.get_rank()
    inside = group is not None and me in ranks
    ops = {"all-reduce": lambda: dist.all_reduce(x, group=group),
           "all-gather": lambda: all_gather_into(x, part, group),
           "reduce-scatter": lambda: reduce_scatter_into(part, x, group)}
    out = {}
    for name, fn in ops.items():
        seconds = time_collective(fn if inside else (lambda: None), device)
        out[name] = numel * 4 / seconds * algorithm_factor(name, n) / 1e9
    # Paired p2p: rank i of the list with rank i + n/2, both directions at once.
    half = n // 2
    peer = None
    if inside and n >= 2 and ranks.index(me) < 2 * half:
        i = ranks.index(me)
        peer = ranks[i + half] if i < half else ranks[i - half]
    recv = torch.empty_like(x)

    def exchange():
        if peer is not None:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer),
                                                dist.P2POp(dist.irecv, recv, peer)]):
                work.wait()
    out["p2p"] = numel * 4 / time_collective(exchange, device) / 1e9
    return out


def layout_messages(configs) -> dict[int, set[str]]:
    """bytes -> what sends a message of about that size, over the layouts `configs`: sizes
    within 25% of the smallest of a run of them are measured once, at the largest."""
    sent = sorted((msg.size, msg.what) for config in configs for msg in step_traffic(config))
    sizes, first = {}, None
    for size, what in sent:
        if first is None or size > 1.25 * first:
            first, names = size, set()
        sizes.pop(next((s for s in sizes if sizes[s] is names), None), None)
        names.add(what)
        sizes[size] = names
    return sizes


def check_collectives(args, rank: int, world: int, device, configs, measured) -> Section:
    """Bus bandwidth at the sizes the layouts `configs` send (or --message-sizes), into
    `measured` {(op, bytes): GB/s over all ranks} for the tuner and the chart."""
    section = Section("Collectives: bus bandwidth (GB/s, nccl-tests' busbw)")
    if world == 1:
        section.lines.append("One rank: no collective to measure.")
        return section
    sizes = ({int(mib * 2 ** 20): {"--message-sizes"} for mib in args.message_sizes}
             if args.message_sizes else layout_messages(configs))
    node, nodes, leaders = node_groups(world)
    scopes = [("all ranks", dist.group.WORLD, list(range(world)))]
    if len(nodes) > 1:
        scopes += [("within a node", node, next(r for r in nodes if rank in r)),
                   ("across nodes (one rank a node)", leaders, [r[0] for r in nodes])]
    rows = []
    for scope, group, ranks in scopes:
        for size in sorted(sizes):
            bandwidth = bus_bandwidths(group, ranks, size, device)
            if scope == "all ranks":
                measured.update({(op, size): bw for op, bw in bandwidth.items()})
            rows.append([scope, f"{size / 2 ** 10:g}", ", ".join(sorted(sizes[size]))]
                        + [f"{bw:.3g}" for bw in bandwidth.values()])
    section.lines += [f"{len(nodes)} node(s), {world} ranks; the slowest rank's time of 5 "
                      "calls after one warm-up. The sizes are those the checked and tuned "
                      "layouts send (megalite/layout_tune.step_traffic: a DP bucket, a TP "
                      "activation, a PP activation, an FSDP2 unit, a CP K/V chunk) unless "
                      "--message-sizes is given.", ""]
    section.lines += table(["ranks", "KiB", "sent by", "all-reduce", "all-gather",
                            "reduce-scatter", "p2p (each direction)"], rows)
    return section

