"""Point-to-point communication between neighbouring pipeline stages (docs/design.md §5, §11).

Stage s+1 lives on the next rank of the pipeline group (stages.py): activations go to the
next rank, their gradients back to the previous one. Under NCCL a send completes only
when the peer has posted the matching receive, each rank's operations complete in the
order issued, and messages between two ranks match in issue order (no tags). Sending
each output on its own and then waiting for the next input deadlocks there as soon as
two neighbours both send first (NVIDIA/nccl#479); gloo buffers sends and hides it.

So every rank runs a plan: before each of its actions one batch of sends and receives,
posted together with `batch_isend_irecv` (Megatron's send_forward_recv_backward and
friends), built from every rank's action list so that both ends of a message sit in
batches that meet. On the simulator's clock (simulate.py) a batch sits at the start of
the action after it:
- a send goes in the batch right after the action that produced it;
- its receive as late as possible: the batch before the consuming action, moved earlier
  while the action before that batch starts no earlier than the send's batch (and never
  after the receive of the sender's next message, so two ranks agree on the order).
Then the batch before either end of a message is earlier on the clock than the other
end: the waiting batch earliest on the clock would wait for a peer at an earlier batch,
so none waits forever. For 1F1B this is exactly Megatron's pairing (each action's list
alone would do); interleaved, the last rank's activations wrap round to the first rank
on a clock the first rank's own list does not show, so the plan reads every rank's.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.parallel_state import ParallelState
from megalite.pipeline_parallel.schedules import BACKWARD, FORWARD, Action
from megalite.pipeline_parallel.simulate import simulate
from megalite.pipeline_parallel.stages import Stage, rank_stages

# Chunk costs on the planning clock; any positive costs give a plan that cannot deadlock.
# A whole backward costs B + W = 2, a split one B = 1 and its weight-gradient pass W = 1.
FORWARD_COST, BACKWARD_COST, WEIGHT_COST = 1, 1, 1


@dataclass(frozen=True)
class Message:
    microbatch: int
    stage: int       # the receiving stage
    backward: bool   # a gradient going back (else an activation going forward)


@dataclass(frozen=True)
class Transfer:
    send: bool
    message: Message

    @property
    def to_next_rank(self) -> bool:
        """Activations are sent to the next rank, gradients received from it."""
        return self.send != self.message.backward


@dataclass(frozen=True)
class RankPlan:
    actions: list[Action]
    batches: list[list[Transfer]]  # batches[j] is posted before actions[j]; one more after
    stages: list[Stage]            # this rank's chunks

    def sends_held(self) -> list[bool]:
        """Per action, whether what it sends is held until the step ends: its batch (the
        one after it) has no receive, so nothing waits for it before wait_all. A batch
        with a receive is waited for at once, and its sent tensors are let go."""
        return [all(t.send for t in batch) for batch in self.batches[1:]]


def action_messages(action: Action, stage: Stage) -> tuple[Message | None, Message | None]:
    """(the message `action` waits for, the one it sends): a forward takes the previous
    stage's activation and sends its output on; a backward takes the gradient of its
    output from the next stage and sends its input's gradient back; a weight-gradient
    pass needs only what its own backward kept."""
    mb, s = action.microbatch, stage.index
    if action.kind not in (FORWARD, BACKWARD):
        return None, None
    if action.kind == FORWARD:
        return (None if stage.is_first else Message(mb, s, False),
                None if stage.is_last else Message(mb, s + 1, False))
    return (None if stage.is_last else Message(mb, s, True),
            None if stage.is_first else Message(mb, s - 1, True))


def communication_plan(schedules: list[list[Action]], num_chunks: int) -> list[RankPlan]:
    """Every rank's plan for `schedules[r]`, the action lists of all pipeline ranks."""
    p = len(schedules)
    stages = [rank_stages(r, p, num_chunks) for r in range(p)]
    clock = _batch_times(schedules, stages, num_chunks)
    batches = [[[] for _ in range(len(actions) + 1)] for actions in schedules]
    sent_at = {}  # message -> (sending rank, its batch)
    for r, actions in enumerate(schedules):
        for i, action in enumerate(actions):
            out = action_messages(action, stages[r][action.chunk])[1]
            if out is not None:
                sent_at[out] = (r, i + 1)
                batches[r][i + 1].append(Transfer(True, out))
    receives = {}  # (receiving rank, sending rank) -> [(send time, message, consumer index)]
    for r, actions in enumerate(schedules):
        for i, action in enumerate(actions):
            wanted = action_messages(action, stages[r][action.chunk])[0]
            if wanted is not None:
                src, j = sent_at[wanted]
                receives.setdefault((r, src), []).append((clock[src][j], wanted, i))
    for (r, _), incoming in receives.items():
        latest = len(schedules[r])
        for sent, message, consumer in sorted(incoming, key=lambda x: -x[0]):
            j = min(consumer, latest)
            while j > 0 and clock[r][j - 1] >= sent:
                j -= 1
            batches[r][j].append(Transfer(False, message))
            latest = j
    # Receives from one sender in the order it sends (a batch holds one send per rank).
    order = {m: clock[r][j] for m, (r, j) in sent_at.items()}
    return [RankPlan(schedules[r], [sorted(b, key=lambda t: (not t.send, order[t.message]))
                                    for b in batches[r]], stages[r]) for r in range(p)]


def _batch_times(schedules, stages, num_chunks) -> list[list[int]]:
    """Per rank, when each batch sits on the simulator's clock: the start of the action
    after it, and for the last batch the end of the last action."""
    sim = simulate(schedules, num_chunks, FORWARD_COST, BACKWARD_COST, WEIGHT_COST)
    times = []
    for r, actions in enumerate(schedules):
        keys = [(a.kind, a.microbatch, stages[r][a.chunk].index) for a in actions]
        times.append([sim.start[k] for k in keys] + [sim.finish[keys[-1]]])
    return times


class PipelineCommunicator:
    """Posts a plan's batches between this rank and its pipeline neighbours."""

    def __init__(self, state: ParallelState, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device):
        grid, p = state.grid, state.pp_size
        self.next_rank, self.prev_rank = (
            grid.rank(state.tp_rank, state.dp_rank, (state.pp_rank + step) % p, state.cp_rank)
            for step in (1, -1))
        self.group, self.shape, self.dtype, self.device = state.pp_group, shape, dtype, device
        self.pending: list = []  # (works, sent tensors) of batches not waited for yet
        self.bytes_sent = 0

    def exchange(self, batch: list[Transfer], outbox: dict) -> dict:
        """Post `batch`, taking what it sends out of `outbox`; return what it received
        (waited for, so the next action can use it) by message."""
        ops, sends, received = [], [], {}
        for transfer in batch:
            peer = self.next_rank if transfer.to_next_rank else self.prev_rank
            if transfer.send:
                tensor = self._checked(outbox.pop(transfer.message))
                sends.append(tensor)
                ops.append(dist.P2POp(dist.isend, tensor, peer, self.group))
            else:
                tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                received[transfer.message] = tensor
                ops.append(dist.P2POp(dist.irecv, tensor, peer, self.group))
        works = dist.batch_isend_irecv(ops)  # NCCL returns one work for the whole batch
        if received:
            for work in works:  # each once: a gloo work waited twice blocks forever
                work.wait()
        elif sends:
            # NCCL reads a sent tensor until its request completes: keep it until then.
            self.pending.append((works, sends))
        return received

    def _checked(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().contiguous()
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(f"pipeline send of {tuple(tensor.shape)} {tensor.dtype}, "
                               f"expected {self.shape} {self.dtype}")
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return tensor

    def wait_all(self):
        """Wait for the batches of sends only (RankPlan.sends_held)."""
        for works, _ in self.pending:
            for work in works:
                work.wait()
        self.pending.clear()
