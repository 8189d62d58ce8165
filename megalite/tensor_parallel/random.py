"""RNG states for dropout under tensor parallelism (Megatron-LM §3, "random number generation").

Dropout on replicated activations (outside tensor-parallel regions, e.g. after a
row-parallel layer) must draw the same mask on every rank of the TP group, so those ranks
keep identical copies: the default generator is seeded identically across the group.
Dropout on sharded activations (attention probabilities of this rank's heads) must draw
independent masks per shard: it runs inside `tracker.fork()`, which swaps in a generator
state seeded differently per TP rank and swaps the default state back afterwards.
"""

import contextlib

import torch
import torch.utils.checkpoint

from megalite.tensor_parallel.weight_grad import temporarily

MODEL_PARALLEL_RNG = "model-parallel-rng"


def model_parallel_seed(seed: int, tp_rank: int) -> int:
    """Megatron's offset: distinct per TP rank, and distinct from the default seed."""
    return seed + 2718 + tp_rank


def get_device_rng_state(device: torch.device) -> torch.Tensor:
    """The state of `device`'s default generator (on a CPU: the host's)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)  # gpu_check: kernels


def set_device_rng_state(state: torch.Tensor, device: torch.device):
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)  # gpu_check: kernels


class RNGStatesTracker:
    """Named generator states that `fork(name)` swaps in for the device's default one."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def add(self, name: str, seed: int):
        if name in self.states:
            raise ValueError(f"RNG state {name!r} is already tracked")
        if seed in self.seeds:
            raise ValueError(f"seed {seed} is already used by another tracked RNG state")
        self.seeds.add(seed)
        # A fresh generator gives the seeded state without touching the default one.
        self.states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not tracked (have {sorted(self.states)})")
        default_state = get_device_rng_state(self.device)
        set_device_rng_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = get_device_rng_state(self.device)
            set_device_rng_state(default_state, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of the tracked states, for a checkpoint."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]):
        """Restore states from `get_states()` (e.g. on resume)."""
        self.states = {name: state.clone() for name, state in states.items()}


def model_parallel_rng(tracker: RNGStatesTracker | None, fork: bool = True):
    """`tracker.fork()` for draws that must differ per TP (and CP) rank; the default
    generator when there is no tracker or no `fork`."""
    return tracker.fork() if tracker is not None and fork else contextlib.nullcontext()


def build_rng_tracker(seed: int, tp_rank: int, device, cp_rank: int = 0,
                      tp_size: int = 1) -> RNGStatesTracker:
    """A tracker holding the per-TP-rank "model-parallel-rng" state; under context
    parallelism per (TP, CP) rank, since each CP rank holds other queries and tokens. The
    caller seeds the default generator with the same seed on every rank of the TP group."""
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, model_parallel_seed(seed, tp_rank + tp_size * cp_rank))
    return tracker


def checkpoint(function, rng_tracker: RNGStatesTracker | None, *args):
    """Activation recompute (Chen et al. 2016; Korthikanti et al. 2022 §4): run `function`
    keeping only its inputs, and run it again in backward to rebuild what it would have
    kept. Dropout must draw the same masks the second time: torch restores the default
    generator (preserve_rng_state), and the tracker's model-parallel states are swapped
    back to what they were before the forward for the recomputation (as Megatron's
    CheckpointFunction does), then forward again."""
    saved = rng_tracker.get_states() if rng_tracker is not None else None

    def contexts():
        recompute = (contextlib.nullcontext() if rng_tracker is None
                     else temporarily(rng_tracker, "states", dict(saved)))
        return contextlib.nullcontext(), recompute
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             preserve_rng_state=True, context_fn=contexts)

