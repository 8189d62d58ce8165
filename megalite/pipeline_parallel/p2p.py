"""Point-to-point communication between neighbouring pipeline stages.

Global stage s = chunk * p + pp_rank (DESIGN.md §5): stage s+1 lives on the next rank of
the pipeline group (wrapping from the last rank to the first, one chunk up). Activations
go forward, their gradients backward; every message carries a tag naming its
(microbatch, receiving stage), so a receive can only match the message it waits for.

Sends are asynchronous (isend, waited at the end of the step) and only receives block:
a rank then blocks only on data its next action needs, and a schedule whose dependencies
can be met in order (what tests/test_schedules.py simulates) cannot deadlock.
"""

import torch
import torch.distributed as dist

from megalite.parallel_state import ParallelState


class PipelineCommunicator:
    def __init__(self, state: ParallelState, num_chunks: int, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device):
        grid, p = state.grid, state.pp_size
        self.pp_rank, self.pp_size, self.num_chunks = state.pp_rank, p, num_chunks
        self.next_rank = grid.rank(state.tp_rank, state.dp_rank, (state.pp_rank + 1) % p)
        self.prev_rank = grid.rank(state.tp_rank, state.dp_rank, (state.pp_rank - 1) % p)
        self.group = state.pp_group
        self.shape, self.dtype, self.device = shape, dtype, device
        self.pending: list = []
        self.bytes_sent = 0

    def stage(self, chunk: int) -> int:
        return chunk * self.pp_size + self.pp_rank

    def _tag(self, microbatch: int, receiving_stage: int, backward: bool) -> int:
        num_stages = self.pp_size * self.num_chunks
        return 2 * (microbatch * num_stages + receiving_stage) + int(backward)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int):
        tensor = tensor.detach().contiguous()
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(f"pipeline send of {tuple(tensor.shape)} {tensor.dtype}, "
                               f"expected {self.shape} {self.dtype}")
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.pending.append((dist.isend(tensor, dst=dst, group=self.group, tag=tag), tensor))

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.irecv(tensor, src=src, group=self.group, tag=tag).wait()
        return tensor

    def send_forward(self, activation: torch.Tensor, microbatch: int, chunk: int):
        self._send(activation, self.next_rank, self._tag(microbatch, self.stage(chunk) + 1, False))

    def recv_forward(self, microbatch: int, chunk: int) -> torch.Tensor:
        return self._recv(self.prev_rank, self._tag(microbatch, self.stage(chunk), False))

    def send_backward(self, grad: torch.Tensor, microbatch: int, chunk: int):
        self._send(grad, self.prev_rank, self._tag(microbatch, self.stage(chunk) - 1, True))

    def recv_backward(self, microbatch: int, chunk: int) -> torch.Tensor:
        return self._recv(self.next_rank, self._tag(microbatch, self.stage(chunk), True))

    def wait_all(self):
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
