"""PowerSGD's state in a checkpoint (distributed/powersgd.py): each rank's error feedback,
last Q and step count, in `powersgd_rank{r}.pt` beside its RNG file.

The error of a DP rank is its own (what it sent minus its share of the sum), so the state
resumes only on the layout that saved it, and then bit-exactly. On any other layout
compression restarts as a fresh run's does, uncompressed until --powersgd-start-iter, and
the reason is printed.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from megalite.checkpointing.storage import load_tensor_file
from megalite.parallel_state import print_rank_0


def compression_file(rank: int) -> str:
    return f"powersgd_rank{rank}.pt"


def compression_record(compressor, layout: dict, copy) -> dict:
    """What this rank's compression file holds, each tensor a host copy by `copy(tensor,
    dtype)`."""
    state = compressor.state_dict()
    return {"layout": layout, "steps": state["steps"],
            **{key: {name: copy(t, None) for name, t in state[key].items()}
               for key in ("errors", "qs")}}


def load_compression_state(directory: Path, compressor, layout: dict,
                           device: torch.device) -> None:
    """Restore this rank's state; or restart compression and say why (rank 0)."""
    path = directory / compression_file(dist.get_rank())
    saved = load_tensor_file(path) if path.exists() else None
    if saved is None:
        reason = f"{directory} holds no PowerSGD state for rank {dist.get_rank()}"
    elif saved["layout"] != layout:
        changed = ", ".join(f"{key} {saved['layout'].get(key)} -> {value}"
                            for key, value in layout.items() if saved["layout"].get(key) != value)
        reason = (f"its state was saved at another layout ({changed}); each DP rank's error "
                  "feedback is its own")
    else:
        compressor.load_state_dict({
            "steps": saved["steps"],
            **{key: {name: t.to(device) for name, t in saved[key].items()}
               for key in ("errors", "qs")}})
        return
    compressor.restart()
    print_rank_0(f" > restarting PowerSGD from uncompressed steps: {reason}")
