"""Context-parallel flags: where --help lists them, what reaches the config, and the
combinations refused by name (issue 14)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from megalite.arguments import build_parser, parse_args
from megalite.errors import ConfigError
from megalite.tensor_parallel.random import MODEL_PARALLEL_RNG, build_rng_tracker
from megalite.validation import validate_args

from tests.helpers import BASE_FLAGS, without

ROOT = Path(__file__).resolve().parent.parent


def config_of(*extra, world_size=1):
    return validate_args(parse_args(BASE_FLAGS + list(extra)), world_size)


def test_help_lists_the_flags_with_the_parallelism_ones():
    text = build_parser().format_help()
    group = text[text.index("parallelism:"):text.index("training:")]
    assert "--context-parallel-size" in group and "--cp-comm-type {p2p,all_gather}" in group


def test_defaults_are_megatrons():
    args = parse_args([])
    assert (args.context_parallel_size, args.cp_comm_type) == (1, "p2p")


def test_flags_reach_the_config():
    config = config_of("--context-parallel-size", "2", "--cp-comm-type", "all_gather",
                       "--tensor-model-parallel-size", "2", world_size=8)
    p = config.parallel
    assert (p.context_parallel_size, p.data_parallel_size) == (2, 2)
    assert p.grid.dp_cp_size == 4
    assert config.model.cp_comm_type == "all_gather"
    # DP = world / (TP x CP x PP): the global batch default is micro-batch x DP.
    default = validate_args(parse_args(without(BASE_FLAGS, "--global-batch-size")
                                       + ["--context-parallel-size", "2",
                                          "--attention-backend", "unfused"]), 4)
    assert default.training.global_batch_size == 4 * 2


def test_every_backend_runs_the_ring():
    """Ring attention runs each block on the chosen backend's kernel (torch's fused flash
    kernels for sdpa and flash, the fp32 block kernel for unfused): the backend reaches the
    model as chosen, "auto" resolved at start-up as without CP."""
    for backend in ("auto", "sdpa", "unfused"):
        config = config_of("--context-parallel-size", "2", "--attention-backend", backend,
                           world_size=2)
        assert (config.model.cp_comm_type, config.model.attention_backend) == ("p2p", backend)
    assert config_of().model.attention_backend == "auto"


@pytest.mark.parametrize("extra, world, words", [
    (["--context-parallel-size", "3", "--cp-comm-type", "all_gather"], 6,
     ["--context-parallel-size=3", "--seq-length=32", "6"]),
    (["--context-parallel-size", "0"], 1, ["--context-parallel-size", "positive"]),
    (["--context-parallel-size", "4", "--cp-comm-type", "all_gather"], 6,
     ["world size 6", "--context-parallel-size=4"]),
    (["--seq-length", "36", "--max-position-embeddings", "36", "--context-parallel-size", "2",
      "--cp-comm-type", "all_gather",
      "--tensor-model-parallel-size", "4", "--sequence-parallel"], 8,
     ["--seq-length=36", "--context-parallel-size=2", "18",
      "--tensor-model-parallel-size=4"]),
])
def test_bad_combinations_name_flags_and_values(extra, world, words):
    with pytest.raises(ConfigError) as error:
        config_of(*extra, world_size=world)
    for word in words:
        assert word in str(error.value), str(error.value)


def test_generate_refuses_context_parallelism(capsys):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "tools" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--vocab-size", "100", "--tokenizer-type", "NullTokenizer",
            "--load", "nowhere", "--context-parallel-size", "2", "--prompt", "1 2"]
    assert generate.main(argv) == 2
    err = capsys.readouterr().err
    assert "--context-parallel-size 1, not 2" in err, err


def test_each_tensor_and_context_rank_draws_its_own_dropout_stream():
    """Attention dropout under CP drops other queries' probabilities on each CP rank: the
    model-parallel RNG stream differs per (TP, CP) rank, and at CP rank 0 it is the one a
    run without CP draws."""
    states = {(t, c): build_rng_tracker(7, t, "cpu", c, 2).states[MODEL_PARALLEL_RNG]
              for t in range(2) for c in range(2)}
    values = list(states.values())
    assert all(not torch.equal(a, b) for i, a in enumerate(values) for b in values[i + 1:])
    for t in range(2):
        without_cp = build_rng_tracker(7, t, "cpu").states[MODEL_PARALLEL_RNG]
        assert torch.equal(states[(t, 0)], without_cp)
