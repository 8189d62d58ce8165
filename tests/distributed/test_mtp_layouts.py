"""Multi-token prediction (--mtp-num-layers 2; docs/design.md §33) on the pipeline against one
process with the same flags: PP 2 (the MTP depths on the last stage, with the embedding's copy
there, tied output layer or not; interleaved; zb-h1), FSDP2 over PP 2 x DP 2 (the embedding
copy sharded), and a checkpoint of TP 2 x PP 2 resumed by one process. fp32, dropout 0: the
same initial values, per-step losses and grad norms, and values after each update. One launch
of 4 ranks; add a layout to LAYOUTS. TP 2 + SP, CP 2 (ring and all_gather: the targets shifted
before the split), EP 2, DP 2 ZeRO-1 and FSDP2 run with MTP in
tests/distributed/test_mla_layouts.py."""

import pytest
import torch

from megalite.checkpointing.loading import load_checkpoint
from megalite.checkpointing.saving import save_checkpoint
from megalite.checkpointing.state import CheckpointState, TrainState
from megalite.layout_check import build_run, first_difference, run_layout, step_problems
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.spawn import run_distributed

from tests.helpers import flags_with, without

pytestmark = pytest.mark.slow  # launches processes

STEPS = 2
BASE = flags_with("--group-query-attention", "--num-query-groups", "2", "--swiglu",
                  "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                  "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
                  "--num-workers", "0", "--mtp-num-layers", "2", vocab_size=12, hidden_size=32,
                  ffn_hidden_size=64, num_layers=2, seq_length=16, micro_batch_size=1,
                  global_batch_size=4, lr="3e-3")
UNTIED = ["--untie-embeddings-and-output-weights"]
FOUR_LAYERS = ["--num-layers", "4"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# name: (ranks, the reference's flags beyond BASE, the layout's flags beyond those)
LAYOUTS = {
    "PP 2 tied": (2, [], ["--pipeline-model-parallel-size", "2"]),
    "PP 2 untied": (2, UNTIED, ["--pipeline-model-parallel-size", "2"]),
    "PP 2 interleaved": (2, FOUR_LAYERS, ["--pipeline-model-parallel-size", "2",
                                          "--num-layers-per-virtual-pipeline-stage", "1"]),
    "PP 2 zb-h1": (2, [], ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                           "zb-h1"]),
    "PP 2 x DP 2 FSDP2 untied": (4, UNTIED, ["--pipeline-model-parallel-size", "2",
                                            "--use-torch-fsdp2"]),
}


def _train(flags, world_size, rank, steps: range, load=None, save=None, save_at=None):
    """(loss, grad norm) of `steps` (iterations, from 1) of `flags`; loads `load` first,
    saves to `save` after iteration `save_at`. None on ranks outside the layout."""
    config, state, model, optimizer, runner, batches = build_run(flags, world_size, rank,
                                                                 torch.device("cpu"))
    if model is None:
        return None
    scheduler = LRScheduler(optimizer, config.scheduler)  # constant: never stepped here
    if load is not None:
        load_checkpoint(load, CheckpointState(model, optimizer, scheduler, state, config))
    m = config.training.num_microbatches
    for _ in range((steps.start - 1) * m):  # the data position of the checkpoint
        next(batches)
    results = []
    for iteration in steps:
        result = runner.train_step([next(batches) for _ in range(m)])
        results.append((result.loss, result.grad_norm))
        if iteration == save_at:
            progress = TrainState(iteration, iteration * config.training.global_batch_size)
            save_checkpoint(save, iteration, CheckpointState(model, optimizer, scheduler, state,
                                                             config, progress))
    return results


def _resume(rank, directory) -> str | None:
    """The MTP weights by their single-process names: saved at TP 2 x PP 2 (untied: the
    last stage holds the embedding's copy, the output layer and the depths) after step 1,
    loaded by one process, steps 2 and 3 those of one process straight through (the
    layouts above: TP 2 x PP 2 is one process's run)."""
    _train(BASE + UNTIED + TP2 + ["--pipeline-model-parallel-size", "2"], 4, rank, range(1, 2),
           save=directory, save_at=1)
    resumed = _train(BASE + UNTIED, 1, rank, range(2, 4), load=directory)
    if resumed is None:
        return None
    straight = _train(BASE + UNTIED, 1, rank, range(1, 4))
    problems = step_problems(resumed, straight[1:], True)
    return "; ".join(problems) if problems else None


def _compare(rank, world_size, directory):
    cpu = torch.device("cpu")
    # Each rank runs the one-process references itself (rank 0 of a world of one).
    references = {ref: run_layout(BASE + list(ref), 1, 0, cpu, STEPS)
                  for ref in {tuple(ref) for _, ref, _ in LAYOUTS.values()}}
    plain = run_layout(without(BASE, "--mtp-num-layers"), 1, 0, cpu, STEPS)
    differences = {"MTP changes the run": None if plain.steps != references[()].steps
                   else "no: same steps"}
    for name, (ranks, ref, layout) in LAYOUTS.items():
        run = run_layout(BASE + list(ref) + layout, ranks, rank, cpu, STEPS)
        differences[name] = run and first_difference(run, references[tuple(ref)])
    differences["resumed by one process from TP 2 x PP 2"] = _resume(rank, directory)
    return differences


def test_mtp_at_every_layout_matches_one_process(tmp_path):
    failures = [f"rank {rank}, {name}: {difference}"
                for rank, differences in enumerate(run_distributed(4, _compare, str(tmp_path),
                                                                   timeout=300))
                for name, difference in differences.items() if difference is not None]
    assert not failures, "\n".join(failures)
