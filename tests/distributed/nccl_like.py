"""gloo made to behave like NCCL on one point: NCCL has no host path, so a collective given
a host tensor fails, where gloo takes it. Under --optimizer-cpu-offload the parameter
shards, their gradients and the optimizer state live on the host, and so does whatever the
step and the monitor compute from them; on a CPU everything is on the host, so a stand-in
is needed to tell a host tensor from one moved to where the collective runs.

    with host_tensors_refused(windows) as check:
        run_training(...)
    check.refused   # [(window, collective, shape), ...]: what NCCL would have refused

megalite moves every tensor that may be on the host through one function,
parallel_state.to_collective_device (a copy on the GPU under NCCL, the tensor itself under
gloo); here it stands in for the move to the GPU: a copy, kept as "on the device". Inside the `windows` (functions whose every collective works on
offloaded state: the optimizer step, the monitor's statistics, saving a checkpoint),
dist.all_reduce, DTensor's all-reduce (funcol.all_reduce) and DTensor.full_tensor record
each tensor they are given that is not such a copy. FSDP2's own all-gathers and
reduce-scatters are torch's, which moves offloaded shards itself, and stay unchecked.
"""

import contextlib
import sys
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

import megalite.parallel_state


class HostTensorCheck:
    def __init__(self):
        self.refused: list[tuple[str, str, tuple]] = []
        self.checked: dict[str, int] = {}
        self._on_device: list[torch.Tensor] = []  # kept alive: their storages stay theirs
        self._window: list[str] = []

    def to_device(self, tensor: torch.Tensor, group) -> torch.Tensor:
        copy = tensor.detach().clone()
        self._on_device.append(copy.to_local() if isinstance(copy, DTensor) else copy)
        return copy

    def _is_on_device(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, DTensor):  # a DTensor handed to a plain collective
            tensor = tensor.to_local()
        storage = tensor.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == storage for t in self._on_device)

    def check(self, collective: str, tensor: torch.Tensor):
        if not self._window:
            return
        window = self._window[-1]
        self.checked[window] = self.checked.get(window, 0) + 1
        if not self._is_on_device(tensor):
            self.refused.append((window, collective, tuple(tensor.shape)))

    def wrap_window(self, name: str, fn):
        def windowed(*args, **kwargs):
            self._window.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self._window.pop()
        return windowed


@contextlib.contextmanager
def host_tensors_refused(windows: dict[str, tuple[object, str]]):
    """`windows`: name -> (owner, attribute) of a function (a class's method or a module's
    function) inside which every collective's tensor must have been moved."""
    check = HostTensorCheck()
    all_reduce, full_tensor, funcol_all_reduce = (dist.all_reduce, DTensor.full_tensor,
                                                  funcol.all_reduce)

    def checked_all_reduce(tensor, *args, **kwargs):
        check.check("dist.all_reduce", tensor)
        return all_reduce(tensor, *args, **kwargs)

    def checked_full_tensor(self, *args, **kwargs):
        check.check("DTensor.full_tensor", self._local_tensor)
        return full_tensor(self, *args, **kwargs)

    def checked_funcol_all_reduce(tensor, *args, **kwargs):
        check.check("funcol.all_reduce", tensor)
        return funcol_all_reduce(tensor, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        patch = lambda owner, name, new: stack.enter_context(mock.patch.object(owner, name, new))
        original = getattr(megalite.parallel_state, "to_collective_device", None)
        for name, module in list(sys.modules.items()):
            if name.startswith("megalite") and original is not None and \
                    getattr(module, "to_collective_device", None) is original:
                patch(module, "to_collective_device", check.to_device)
        patch(dist, "all_reduce", checked_all_reduce)
        patch(DTensor, "full_tensor", checked_full_tensor)
        patch(funcol, "all_reduce", checked_funcol_all_reduce)
        for name, (owner, attribute) in windows.items():
            patch(owner, attribute, check.wrap_window(name, getattr(owner, attribute)))
        yield check
