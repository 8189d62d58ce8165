"""PowerSGD (--grad-compression powersgd) in one launch of 4 ranks:

- against torch's own `powerSGD_hook` on DistributedDataParallel, at DP 2 and DP 4: the
  same model, data, rank, start iteration and first Q (megalite's draw, put into the hook's
  state where the hook would draw its own), 20 steps of the same losses;
- layouts: PowerSGD only ever uses sums over the reduction group, so PowerSGD at DP2 x TP2
  (with SP), DP2 x PP2 (tied embeddings), DP2 x CP2, DP 2 under ZeRO-1 and DP 4 under
  ZeRO-1 with hybrid sharding (N = 2) compute what PowerSGD at DP 2 computes, and DP 4 does
  too: both equal torch's hook above
  (docs/design.md "Gradient compression");
- bytes: what the DP collectives were given in a step (at DP 4), uncompressed and
  compressed, equals the closed form;
- checkpoints: same-layout resume is bit-exact (error feedback, Q and step count saved);
  a DP 4 checkpoint loaded at DP 2 restarts compression from uncompressed, saying why.
"""

import contextlib
import io
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (PowerSGDState,
                                                                        _should_compress,
                                                                        powerSGD_hook)

import pytest

from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.distributed.powersgd import initial_q, single_process_names
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.spawn import run_distributed
from megalite.checkpointing.state import CheckpointState, TrainState
from megalite.layout_check import build_run, first_difference, run_layout
from tests.helpers import flags_with

pytestmark = pytest.mark.slow  # launches processes

RANK, START, STEPS, SEED = 2, 3, 20, 1234
CPU = torch.device("cpu")


def flags(*extra, **values):
    return flags_with("--grad-compression", "powersgd", "--powersgd-rank", str(RANK),
                      "--powersgd-start-iter", str(START), "--lr-decay-style", "constant",
                      "--clip-grad", "0", "--weight-decay", "0", "--seed", str(SEED),
                      "--hidden-dropout", "0", "--attention-dropout", "0", *extra,
                      **{"global_batch_size": 8, "micro_batch_size": 2, "hidden_size": 32,
                         "train_iters": STEPS, **values})


# ------------------------------------------------------------------ torch's hook

def _prefill_hook(names):
    """torch's powerSGD_hook, given megalite's first Qs: at the first compressed step each
    bucket's Q memory is laid out as the hook lays it out (its compressed tensors grouped by
    shape, in first-seen order) and filled with `initial_q`, so the hook orthogonalises
    those instead of drawing its own."""
    def hook(state, bucket):
        if state.iter == state.start_powerSGD_iter and bucket.index() not in state.p_memory_dict:
            by_shape = {}
            for p in bucket.parameters():
                n = p.shape[0]
                m = p.numel() // n
                r = min(n, m, state.matrix_approximation_rank)
                if _should_compress(n, m, r, state.min_compression_rate)[0]:
                    by_shape.setdefault((n, m), []).append((p, r))
            qs = [initial_q(names[id(p)], m, r, SEED, START).view(-1)
                  for (n, m), group in by_shape.items() for p, r in group]
            p_size = sum(n * r for (n, m), group in by_shape.items() for _, r in group)
            state.p_memory_dict[bucket.index()] = torch.empty(p_size)
            state.q_memory_dict[bucket.index()] = torch.cat(qs)
        return powerSGD_hook(state, bucket)
    return hook


def torch_reference(rank, dp) -> list[float] | None:
    """STEPS losses of megalite's model under torch's DDP + powerSGD_hook at DP `dp`."""
    config, state, model, _, _, batches = build_run(flags(micro_batch_size=8 // dp), dp,
                                                    rank, CPU)
    if model is None:
        return None
    module = model[0]
    for p in module.parameters():
        p.grad = None  # build_run's gradient buffer pointed them at its views
    names = single_process_names(model)
    ddp = torch.nn.parallel.DistributedDataParallel(module, process_group=state.dp_group)
    ddp.register_comm_hook(PowerSGDState(state.dp_group, matrix_approximation_rank=RANK,
                                         start_powerSGD_iter=START, random_seed=0),
                           _prefill_hook(names))
    o = config.optimizer
    adam = torch.optim.AdamW(module.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                             eps=o.adam_eps, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        batch = next(batches)  # one micro-batch per rank and step
        tokens = batch["loss_mask"].sum()
        global_tokens = tokens.clone()
        dist.all_reduce(global_tokens, group=state.dp_group)
        # DDP averages: each rank's loss is its share of the global token mean, times DP.
        token_losses = ddp(batch["tokens"], batch["labels"])
        loss = (token_losses * batch["loss_mask"]).sum() * dp / global_tokens
        adam.zero_grad()
        loss.backward()
        adam.step()
        total = loss.detach() / dp
        dist.all_reduce(total, group=state.dp_group)
        losses.append(total.item())
    return losses


def against_torch(rank) -> tuple[dict[str, str | None], dict]:
    """The comparisons, and megalite's runs (LayoutRun by DP; None off the layout)."""
    out, runs = {}, {}
    for dp in (2, 4):
        runs[dp] = mine = run_layout(flags(micro_batch_size=8 // dp), dp, rank, CPU, STEPS)
        ref = torch_reference(rank, dp)
        if mine is None:
            continue
        worst = max(abs(a - b) / abs(b) for (a, _), b in zip(mine.steps, ref))
        out[f"DP{dp} vs torch"] = None if worst < 1e-5 else \
            f"losses {[s[0] for s in mine.steps]} vs {ref} (worst rel {worst:.2g})"
    return out, runs


# ------------------------------------------------------------------ layouts

LAYOUTS = {"DP2 x TP2 (SP)": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
           "DP2 x PP2 (tied embeddings on two stages)": (4, ["--pipeline-model-parallel-size",
                                                             "2"]),
           "DP2 x CP2": (4, ["--context-parallel-size", "2"]),
           "DP2 ZeRO-1": (2, ["--use-distributed-optimizer"]),
           # Hybrid sharding: compressed over all four ranks, each steps its shard of a
           # shard group of 2 (docs/design.md "Hybrid sharding").
           "DP4 ZeRO-1, N 2": (4, ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                   "--num-distributed-optimizer-instances", "2"])}
LAYOUT_STEPS = 6  # 3 uncompressed, then 3 compressed (the first Q, then warm starts)


def layouts(rank, dp2) -> dict[str, str | None]:
    """Each layout against `dp2`, the DP 2 run compared with torch's hook (4 micro-batches
    of 2 per step here, 1 of 4 there: the same global batch)."""
    reference = [dp2]
    dist.broadcast_object_list(reference, src=0)  # ranks 2 and 3 had no part in it
    out = {}
    for name, (world, extra) in LAYOUTS.items():
        mine = run_layout(flags(*extra), world, rank, CPU, LAYOUT_STEPS)
        if mine is not None:
            out[name] = first_difference(mine, reference[0])
    return out


# ------------------------------------------------------------------ bytes

def closed_form_bytes(h: int, ffn: int, vocab: int, layers: int, seq: int, rank: int) -> int:
    """One rank's payload in a compressed step of the GPT of BASE flags (learned absolute
    positions, LayerNorm with biases, tied embeddings): fp32 (n + m) x rank per weight
    matrix, the vectors as they are (fp32)."""
    matrices = [(vocab, h), (seq, h)] + layers * [(3 * h, h), (h, h), (ffn, h),
                                                              (h, ffn)]
    vectors = 2 * h + layers * (2 * h + 3 * h + h + 2 * h + ffn + h)  # final LN; per layer
    return 4 * sum((n + m) * rank for n, m in matrices) + 4 * vectors


# ------------------------------------------------------------------ checkpoints

class Run:
    """build_run's pieces for flags() at DP `dp`, stepped as the training loop steps them."""

    def __init__(self, rank, dp):
        self.config, self.state, self.model, self.optimizer, self.runner, self.batches = \
            build_run(flags(), dp, rank, CPU)
        self.bytes_sent = []
        if self.model is not None:
            self.scheduler = LRScheduler(self.optimizer, self.config.scheduler)
            self.compressor = self.runner.grad_buffer.compressor

    def steps(self, n) -> list[float]:
        micro = self.config.training.num_microbatches
        losses = []
        for _ in range(n):
            losses.append(self.runner.train_step([next(self.batches)
                                                  for _ in range(micro)]).loss)
            self.bytes_sent.append(self.runner.grad_buffer.bytes_sent)
        return losses

    def values(self) -> dict[str, torch.Tensor]:
        """By single-process name, as LayoutRun.values has them."""
        return {n.split(".", 1)[1]: p.detach().clone() for n, p in self.model.named_parameters()}


def checkpoints(rank, straight) -> tuple[dict[str, str | None], list[int]]:
    """`straight` (6 of the DP 4 run's steps) against 4 steps, save, load into a new run, 2
    more: the same losses and values, bit for bit; the DP 4 checkpoint loaded at DP 2
    restarts PowerSGD. Also the bytes the first run's steps sent."""
    where = [tempfile.mkdtemp(prefix="powersgd-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    losses, values = [loss for loss, _ in straight.steps[:6]], straight.values[5]
    first = Run(rank, 4)
    first.steps(4)
    save_checkpoint(where[0], 4, CheckpointState(
        first.model, first.optimizer, first.scheduler, first.state, first.config,
        TrainState(4, 32), compressor=first.compressor))
    second = Run(rank, 4)
    load_checkpoint(where[0], CheckpointState(second.model, second.optimizer, second.scheduler,
                                              second.state, second.config,
                                              compressor=second.compressor))
    for _ in range(4 * second.config.training.num_microbatches):
        next(second.batches)  # past the data the first run consumed
    out = {"same-layout resume": None}
    if second.compressor.steps != 4 or losses[4:] != second.steps(2) or \
            any(not torch.equal(v, values[n]) for n, v in second.values().items()):
        out["same-layout resume"] = "not bit-exact"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        other = Run(rank, 2)
        if other.model is not None:
            load_checkpoint(where[0], CheckpointState(
                other.model, other.optimizer, other.scheduler, other.state, other.config,
                compressor=other.compressor))
    if rank == 0:
        restarted = other.compressor.steps == 0 and not other.compressor.errors
        out["DP 4 -> 2 restarts"] = None if restarted and \
            "restarting PowerSGD from uncompressed steps" in printed.getvalue() else \
            f"steps {other.compressor.steps}, printed {printed.getvalue()!r}"
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where[0])
    return out, first.bytes_sent


def everything(rank, world_size):
    torch_problems, runs = against_torch(rank)
    checkpoint_problems, sent = checkpoints(rank, runs[4])
    return {"torch": torch_problems, "layouts": layouts(rank, runs[2]),
            "checkpoints": checkpoint_problems,
            "bytes": {"uncompressed": sent[0], "compressed": sent[START]}}


def test_powersgd_matches_torch_and_every_layout():
    results = run_distributed(4, everything, timeout=300)
    failures = {f"rank {r} {what}": problem for r, result in enumerate(results)
                for part in ("torch", "layouts", "checkpoints")
                for what, problem in result[part].items() if problem}
    assert not failures, failures
    assert set(results[0]["torch"]) == {"DP2 vs torch", "DP4 vs torch"}
    assert set(results[0]["layouts"]) == set(LAYOUTS)
    assert set(results[0]["checkpoints"]) == {"same-layout resume", "DP 4 -> 2 restarts"}
    sent = results[0]["bytes"]
    h, vocab, layers, seq = 32, 64, 2, 32
    assert sent["compressed"] == closed_form_bytes(h, 4 * h, vocab, layers, seq, RANK)
    # Before the start iteration: the whole buffer (fp32, padded to DP) in one all-reduce.
    assert sent["uncompressed"] == 4 * closed_form_params(h, 4 * h, vocab, layers, seq)


def closed_form_params(h, ffn, vocab, layers, seq) -> int:
    """Parameters of that GPT (every tensor in one bucket; an even count, no DP padding)."""
    matrices = vocab * h + seq * h + layers * (3 * h * h + h * h + 2 * ffn * h)
    return matrices + 2 * h + layers * (2 * h + 3 * h + h + 2 * h + ffn + h)
