"""The compiled default (--compile-layers) on the flag sets of the shipped configs that train
with ZeRO-1 and --overlap-param-gather (examples/configs), at tiny size, at DP 2, with every
parameter in a bucket of its own: dynamo's own records say each compiled function (the
layers' shared forward, the loss) compiled once and whole, with no recompile and no graph
break (docs/design.md §23, "Once and whole"). Those failures are the same on every device;
on a GPU the layers past dynamo's recompile limit would run eagerly, slower and bigger than
the memory planner plans them (issue 39: the parameter all-gather's wait hooked inside each
layer).

torch.compile's backend is "eager": dynamo's capture, guards and graph breaks, then the
captured graphs run as they are (what is checked here happens before any backend runs).
"""

import functools
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

from megalite.arguments import parse_args
from megalite.parallel_state import ParallelState
from megalite.spawn import run_distributed
from megalite.tensor_parallel.random import build_rng_tracker
from megalite.train_step import StepRunner
from megalite.training import build_model, build_optimizer
from megalite.validation import validate_args

pytestmark = pytest.mark.slow  # every test here launches processes

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
# The configs' flags at tiny size, TP 1 (the compile default's) so that two ranks are DP 2,
# and a bucket per parameter: every layer's in buckets of its own, as a 1.1B model's are.
TINY = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "8",
        "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings", "32",
        "--vocab-size", "64", "--make-vocab-size-divisible-by", "64", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
        "--lr-warmup-iters", "0", "--tensor-model-parallel-size", "1", "--ddp-bucket-size", "1",
        "--compile-layers"]
STEPS = 2  # the second step's forward waits for the first step's all-gathers


def zero1_overlap_configs() -> list[Path]:
    chosen = [path for path in sorted(CONFIGS.glob("*.yaml"))
              if (args := parse_args(["--yaml-cfg", str(path)])).use_distributed_optimizer
              and args.overlap_param_gather]
    assert len(chosen) >= 5, chosen  # gpt2_125m, gpt2_350m, llama_1b, llama_7b, llama_13b_4x8
    return chosen


def compile_problems(config, state) -> list[str]:
    """STEPS training steps of the compiled model; what dynamo recorded that it should not."""
    cpu = torch.device("cpu")
    torch._dynamo.reset()  # every flag set traces anew
    counters.clear()
    clear_compilation_metrics()
    chunks = build_model(config, state, cpu, build_rng_tracker(config.training.seed,
                                                               state.tp_rank, cpu))
    optimizer, grad_buffer = build_optimizer(chunks, config, state)
    layers = list(chunks[0].decoder.layers.values())
    problems = [] if all(layer._compiled_call_impl is not None for layer in layers) else \
        ["the layers did not compile"]
    bucket_of = {id(p): i for i, b in enumerate(grad_buffer.buckets) for p in b.params}
    buckets = {frozenset(bucket_of[id(p)] for p in layer.parameters()) for layer in layers}
    if len(buckets) < len(layers):
        problems.append(f"layers share buckets: {len(buckets)} sets for {len(layers)} layers")
    runner = StepRunner(chunks, optimizer, config, state, cpu, grad_buffer)
    t, m = config.training, config.model
    tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length),
                           generator=torch.Generator().manual_seed(0))
    for _ in range(STEPS):
        runner.train_step([{"tokens": tokens, "labels": tokens.roll(-1, 1),
                            "loss_mask": torch.ones(tokens.shape)}] * t.num_microbatches)
    compiles = get_compilation_metrics()
    problems += [f"recompiled {c.co_name}: {c.recompile_reason}" for c in compiles
                 if c.recompile_reason]
    problems += [f"graph break (x{n}): {' '.join(reason.split())[:400]}"
                 for reason, n in counters["graph_break"].items()]
    if not any(c.co_name == "forward" and c.graph_op_count for c in compiles):
        problems.append("no layer forward was captured")
    return problems


def compiled_runs(rank, world_size) -> dict[str, list[str]]:
    torch.compile = functools.partial(torch.compile, backend="eager")
    out = {}
    for path in zero1_overlap_configs():
        config = validate_args(parse_args(["--yaml-cfg", str(path), *TINY]), world_size)
        out[path.name] = compile_problems(config, ParallelState(config.parallel.grid, rank))
    return out


def test_compiled_layers_compile_once_and_whole_on_the_shipped_configs():
    results = run_distributed(2, compiled_runs, timeout=600)
    failures = [f"rank {rank}, {name}: {problem}" for rank, result in enumerate(results)
                for name, problems in result.items() for problem in problems]
    assert not failures, "\n".join(failures)
