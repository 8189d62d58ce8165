"""Ring wire bytes per rank, counted at torch.distributed's collectives: 2(n-1)/n x the
tensor for an all-reduce over n ranks, (n-1)/n x the full tensor for a reduce-scatter or an
all-gather (what each rank sends in a ring). Scalars (the loss, token counts, norms) are
left out. Shared by the benchmarks that compare traffic with a closed form."""

import contextlib

import torch.distributed as dist

WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_gather": lambda n: (n - 1) / n}
# (position, keyword) of the full-size tensor of each collective: FSDP2 passes keywords.
_FULL = {"all_reduce": (0, "tensor"), "reduce_scatter_tensor": (1, "input"),
         "reduce_scatter_single": (1, "input"), "all_gather_into_tensor": (0, "output_tensor"),
         "all_gather_single": (0, "output_tensor")}


def count_wire_bytes(counter: dict):
    """Wrap the collectives (for the rest of the process) to add each one's ring wire bytes
    to counter[group] (None: the default group)."""
    for name, (position, keyword) in _FULL.items():
        original = getattr(dist, name, None)
        if original is None:
            continue
        kind = next(k for k in WIRE if name.startswith(k))

        def wrapped(*args, _original=original, _kind=kind, _at=(position, keyword), **kwargs):
            tensor = args[_at[0]] if len(args) > _at[0] else kwargs[_at[1]]
            group = kwargs.get("group")
            if tensor.numel() > 1:
                counter[group] = counter.get(group, 0.0) + WIRE[_kind](
                    dist.get_world_size(group)) * tensor.numel() * tensor.element_size()
            return _original(*args, **kwargs)
        setattr(dist, name, wrapped)


@contextlib.contextmanager
def counting_wire_bytes(counter: dict):
    """count_wire_bytes for the duration of the block only."""
    originals = {name: getattr(dist, name) for name in _FULL if hasattr(dist, name)}
    count_wire_bytes(counter)
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
