"""--expert-model-parallel-size: what validation accepts and what it refuses by name."""

import pytest

from megalite.arguments import parse_args
from megalite.errors import ConfigError
from megalite.validation import validate_args

from tests.helpers import flags_with

MOE = flags_with("--swiglu", "--disable-bias-linear", "--num-experts", "4",
                 "--moe-ffn-hidden-size", "16", hidden_size=32, ffn_hidden_size=64,
                 micro_batch_size=1, global_batch_size=8)


def config(*flags, world_size=4):
    return validate_args(parse_args(MOE + list(flags)), world_size)


def test_expert_parallel_is_carved_out_of_data_times_context_parallel():
    parallel = config("--expert-model-parallel-size", "2", "--context-parallel-size", "2").parallel
    assert parallel.expert_model_parallel_size == 2
    assert parallel.grid.expert_groups() == [[0, 1], [2, 3]]  # DP 2 x CP 2, CP fastest


@pytest.mark.parametrize("flags, world_size, message", [
    (["--expert-model-parallel-size", "3"], 4,
     r"--expert-model-parallel-size=3 must divide data x context parallel = 4 x 1 = 4"),
    (["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"], 2, r"--expert-model-parallel-size=2 must divide .* = 1"),
    (["--expert-model-parallel-size", "3", "--global-batch-size", "6"], 6,
     r"--num-experts=4 is not divisible by --expert-model-parallel-size=3"),
    (["--expert-model-parallel-size", "2", "--use-distributed-optimizer",
      "--num-distributed-optimizer-instances", "4"], 4,
     r"--num-distributed-optimizer-instances=4 must divide expert-data-parallel "
     r"\(DP x CP / EP = 2\)"),
    (["--expert-model-parallel-size", "2", "--data-parallel-shares", "1,1,1,1"], 4,
     r"--data-parallel-shares with --expert-model-parallel-size=2 is not built"),
    (["--expert-model-parallel-size", "2", "--grad-compression", "powersgd"], 4,
     r"--grad-compression powersgd with --expert-model-parallel-size=2 is not built"),
])
def test_refused_by_name(flags, world_size, message):
    with pytest.raises(ConfigError, match=message):
        config(*flags, world_size=world_size)
