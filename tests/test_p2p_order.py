"""The pipeline p2p plan replayed under NCCL's rules, without communication (issue 13).

NCCL, unlike gloo, ignores tags and has no buffering to rely on: a send completes only
when the peer has posted the matching receive; each rank's operations complete in the
order issued (a batch_isend_irecv completes as a unit, once all its operations can);
messages between two ranks match in issue order. `replay` plays every rank's batches
under those rules and reports a deadlock, or a receive matched with another message
than the one it is posted for (two same-shaped tensors would train on wrong data).

The plans replayed are the ones the executor runs (`communication_plan`; a recording
communicator below checks that the executor posts exactly them). Today's executor
before the fix, each send and each receive on its own, is kept as `unpaired_plan` and
must deadlock; 1F1B must pair as Megatron does.
"""

import contextlib
import gc
import types
import weakref

import pytest
import torch

from megalite.pipeline_parallel import p2p
from megalite.pipeline_parallel.executor import run_schedule
from megalite.pipeline_parallel.p2p import (Message, PipelineCommunicator, Transfer,
                                            action_messages, communication_plan)
from megalite.pipeline_parallel.schedules import build_schedule, forward_only
from megalite.pipeline_parallel.stages import rank_stages
from megalite.tensor_parallel.weight_grad import LinearStep

# (p, m, v): 1F1B for every m up to 4p, interleaved for m a multiple of p (as test_schedules).
GRID = [(p, m, 1) for p in range(1, 9) for m in range(1, 4 * p + 1)] + \
       [(p, m, v) for p in range(2, 9) for v in range(2, 5) for m in range(p, 4 * p + 1, p)]
SCHEDULES = {"train": build_schedule, "eval": forward_only}
# GPipe and ZB-H1 (one chunk per rank): ZB-H1's weight-gradient passes send nothing but
# move every later message on the clock.
ONE_CHUNK = {name: lambda p, r, m, v, name=name: build_schedule(p, r, m, v, name)
             for name in ("gpipe", "zb-h1")}


class Deadlock(AssertionError):
    pass


def _peer(rank: int, transfer: Transfer, p: int) -> int:
    return (rank + 1) % p if transfer.to_next_rank else (rank - 1) % p


def replay(plans: list[list[list[Transfer]]]) -> None:
    """Run every rank's batches under NCCL's rules; raise Deadlock or AssertionError."""
    p = len(plans)
    queues = {}  # (src, dst) -> sends, receives: [(rank, batch index, message)] in issue order
    for rank, batches in enumerate(plans):
        for j, batch in enumerate(batches):
            for t in batch:
                peer = _peer(rank, t, p)
                link = (rank, peer) if t.send else (peer, rank)
                queues.setdefault(link, ([], []))[0 if t.send else 1].append((rank, j, t))
    partner = {}
    for (src, dst), (sends, recvs) in queues.items():
        assert len(sends) == len(recvs), \
            f"rank {src} sends {len(sends)} messages to rank {dst}, which receives {len(recvs)}"
        for (r, j, s), (q, k, t) in zip(sends, recvs):
            assert s.message == t.message, \
                f"rank {dst} receives {s.message} from rank {src} as {t.message}"
            partner[(r, j, s)], partner[(q, k, t)] = (q, k), (r, j)
    head, done = [0] * p, set()
    while any(head[r] < len(plans[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if head[r] == len(plans[r]):
                continue
            for t in plans[r][head[r]]:
                q, k = partner[(r, head[r], t)]
                if head[q] == k:  # both ends posted and everything before them completed
                    done |= {(r, head[r], t), (q, k, Transfer(not t.send, t.message))}
            if all((r, head[r], t) in done for t in plans[r][head[r]]):
                head[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: plans[r][head[r]] for r in range(p) if head[r] < len(plans[r])}
            raise Deadlock(f"p2p deadlock; rank -> batch it waits in: {stuck}")


def plans_for(schedule, p, m, v):
    return communication_plan([schedule(p, r, m, v) for r in range(p)], v)


def unpaired_plan(actions, stages):
    """The executor before issue 13: receive an action's input on its own, run it, send its
    output on its own (isend, waited at the end of the step; NCCL still runs it in order)."""
    batches = []
    for action in actions:
        wanted, sent = action_messages(action, stages[action.chunk])
        batches += [[Transfer(False, wanted)]] if wanted else []
        batches += [[Transfer(True, sent)]] if sent else []
    return batches


def megatron_pairing(actions, stages):
    """Megatron's 1F1B: the send of one action's output and the receive of the next
    action's input in one batch (send_forward_recv_backward, send_backward_recv_forward,
    send_forward_recv_forward), as a set per batch."""
    batches = [set() for _ in range(len(actions) + 1)]
    for i, action in enumerate(actions):
        wanted, sent = action_messages(action, stages[action.chunk])
        if wanted:
            batches[i].add(Transfer(False, wanted))
        if sent:
            batches[i + 1].add(Transfer(True, sent))
    return batches


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("p, m, v", GRID, ids=[f"p{p}-m{m}-v{v}" for p, m, v in GRID])
def test_plan_cannot_deadlock_under_nccl(kind, p, m, v):
    check_plans(SCHEDULES[kind], p, m, v)


def check_plans(schedule, p, m, v):
    plans = plans_for(schedule, p, m, v)
    replay([plan.batches for plan in plans])
    for plan in plans:  # every input received before its action, every output sent after
        received, produced = set(), set()
        for action, batch in zip(plan.actions, plan.batches):
            received |= {t.message for t in batch if not t.send}
            assert all(t.message in produced for t in batch if t.send)
            wanted, sent = action_messages(action, plan.stages[action.chunk])
            assert wanted is None or wanted in received, f"{action} runs before receiving"
            produced |= {sent} if sent else set()


@pytest.mark.parametrize("kind", ONE_CHUNK)
@pytest.mark.parametrize("p, m", [(p, m) for p in range(1, 9) for m in range(1, 4 * p + 1)])
def test_gpipe_and_zb_h1_plans_cannot_deadlock_under_nccl(kind, p, m):
    check_plans(ONE_CHUNK[kind], p, m, 1)


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("p, m", [(p, m) for p in range(2, 9) for m in range(1, 4 * p + 1)])
def test_one_f_one_b_pairs_as_megatron(kind, p, m):
    for plan in plans_for(SCHEDULES[kind], p, m, 1):
        assert [set(b) for b in plan.batches] == megatron_pairing(plan.actions, plan.stages)


@pytest.mark.parametrize("p, m, v", [(2, 2, 1), (4, 8, 1), (8, 3, 1), (2, 4, 2), (4, 8, 3)])
def test_unpaired_order_deadlocks(p, m, v):
    """The old order: a rank sending forward then receiving backward while its neighbour
    sends backward then receives forward."""
    with pytest.raises(Deadlock):
        replay([unpaired_plan(build_schedule(p, r, m, v), rank_stages(r, p, v))
                for r in range(p)])


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (3, 9, 4)])
def test_pairing_from_one_rank_list_deadlocks_interleaved(p, m, v):
    """Why the plan reads every rank's list: Megatron's 1F1B pairing applied to each
    interleaved list alone hangs where the last rank's activations wrap to the first."""
    with pytest.raises(Deadlock):
        replay([[list(b) for b in megatron_pairing(build_schedule(p, r, m, v),
                                                   rank_stages(r, p, v)) if b]
                for r in range(p)])


def test_replay_catches_swapped_receives():
    # p=2 interleaved: rank 1 receives activations and gradients from rank 0; two of them
    # in swapped order still match in count and shape, but not in message.
    plans = [plan.batches for plan in plans_for(build_schedule, 2, 4, 2)]
    receives = [(j, i) for j, batch in enumerate(plans[1])
                for i, t in enumerate(batch) if not t.send]
    (j1, i1), (j2, i2) = receives[2], receives[3]
    plans[1][j1][i1], plans[1][j2][i2] = plans[1][j2][i2], plans[1][j1][i1]
    with pytest.raises(AssertionError, match="receives Message.* as Message"):
        replay(plans)


class RecordingCommunicator:
    """Stands in for PipelineCommunicator: records each batch, sends nothing."""

    def __init__(self):
        self.batches = []

    def exchange(self, batch, outbox):
        self.batches.append(batch)
        for t in batch:
            if t.send:
                outbox.pop(t.message)
        return {t.message: torch.ones(2) for t in batch if not t.send}

    def wait_all(self):
        pass


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("p, m, v", [(1, 3, 1), (4, 6, 1), (2, 4, 2), (3, 6, 3)])
def test_executor_posts_the_plan(kind, p, m, v):
    weight = torch.ones(2, requires_grad=True)

    def chunk(x, labels, document_starts=None):  # a model chunk's signature
        return x.float() * weight

    microbatches = [{"tokens": torch.ones(2), "labels": None} for _ in range(m)]
    for plan in plans_for(SCHEDULES[kind], p, m, v):
        comm = RecordingCommunicator()
        run_schedule(plan, [chunk] * v, microbatches, comm, lambda out, mb: out.sum(),
                     lambda loss: loss, contextlib.nullcontext, LinearStep(),
                     forward_only=kind == "eval")
        assert comm.batches == [b for b in plan.batches if b]


@pytest.mark.parametrize("kind", ONE_CHUNK)
@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (4, 6)])
def test_executor_posts_the_plan_of_gpipe_and_zb_h1(kind, p, m):
    weight = torch.ones(2, requires_grad=True)

    def chunk(x, labels, document_starts=None):  # a model chunk's signature
        return x.float() * weight

    microbatches = [{"tokens": torch.ones(2), "labels": None} for _ in range(m)]
    for plan in plans_for(ONE_CHUNK[kind], p, m, 1):
        comm = RecordingCommunicator()
        run_schedule(plan, [chunk], microbatches, comm, lambda out, mb: out.sum(),
                     lambda loss: loss, contextlib.nullcontext, LinearStep())
        assert comm.batches == [b for b in plan.batches if b]


class FakeWork:
    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1


def test_communicator_lets_go_of_a_send_once_its_batch_is_waited(monkeypatch):
    """A batch with a receive is waited for at once: its sent tensors are let go then
    (not held to the end of the step); a batch of sends only is held until wait_all, which
    waits for each of its works once (NCCL reads a send until its request completes)."""
    works = []

    def batch_isend_irecv(ops):
        works.append(FakeWork())
        return [works[-1]]
    monkeypatch.setattr(p2p, "dist", types.SimpleNamespace(
        isend="isend", irecv="irecv", P2POp=lambda op, tensor, peer, group: (op, tensor),
        batch_isend_irecv=batch_isend_irecv))
    comm = object.__new__(PipelineCommunicator)  # no process group: dist is faked above
    comm.next_rank, comm.prev_rank, comm.group = 1, 1, None
    comm.shape, comm.dtype, comm.device = (2,), torch.float32, torch.device("cpu")
    comm.pending, comm.bytes_sent = [], 0
    sent = [Message(mb, 1, False) for mb in range(3)]
    outbox = {message: torch.ones(2) for message in sent}
    alive = [weakref.ref(t.untyped_storage()) for t in outbox.values()]
    gradient = Message(0, 0, True)
    # Micro-batch 0's activation goes with a receive, 1's and 2's alone.
    assert list(comm.exchange([Transfer(True, sent[0]), Transfer(False, gradient)],
                              outbox)) == [gradient]
    comm.exchange([Transfer(True, sent[1])], outbox)
    comm.exchange([Transfer(True, sent[2])], outbox)
    assert not outbox
    gc.collect()
    assert [ref() is not None for ref in alive] == [False, True, True]
    assert [w.waits for w in works] == [1, 0, 0]
    comm.wait_all()
    gc.collect()
    assert [ref() is not None for ref in alive] == [False, False, False]
    assert [w.waits for w in works] == [1, 1, 1]
