"""The MoE flags (validation/moe.py): Megatron's names reach GPTConfig, --moe-layer-freq
becomes one flag per layer, and what megalite does not build is refused by name."""

import pytest

from megalite.arguments import parse_args
from megalite.errors import ConfigError
from megalite.validation import validate_args
from megalite.validation.moe import layer_pattern

from tests.helpers import flags_with

MOE = ["--disable-bias-linear", "--num-experts", "4"]


def _config(*extra, world_size=1):
    return validate_args(parse_args(flags_with(*MOE, *extra)), world_size)


def test_flags_reach_the_model_config():
    model = _config("--moe-router-topk", "1", "--moe-layer-freq", "2",
                    "--moe-router-score-function", "sigmoid",
                    "--moe-router-enable-expert-bias", "--moe-expert-capacity-factor", "1.5",
                    "--moe-token-drop-policy", "position", "--moe-grouped-gemm",
                    "--moe-shared-expert-intermediate-size", "64").model
    assert (model.num_experts, model.moe_router_topk, model.moe_layer_pattern) == \
        (4, 1, (True, False))
    assert model.moe_ffn_hidden_size == model.ffn_hidden_size == 256
    assert (model.moe_router_score_function, model.moe_router_enable_expert_bias,
            model.moe_expert_capacity_factor, model.moe_token_drop_policy,
            model.moe_grouped_gemm, model.moe_shared_expert_intermediate_size,
            model.moe_router_bias_update_rate) == ("sigmoid", True, 1.5, "position", True, 64,
                                                   1e-3)
    dense = validate_args(parse_args(flags_with()), 1).model
    assert dense.num_experts is None and dense.moe_layer_pattern is None


def test_layer_freq_as_megatron_reads_it():
    assert layer_pattern("1", 3) == (True, True, True)
    assert layer_pattern("3", 4) == (True, False, False, True)
    assert layer_pattern("([1]*3+[0]*1)", 4) == (True, True, True, False)
    assert layer_pattern("[0,1]", 2) == (False, True)


@pytest.mark.parametrize("extra, words", [
    (["--moe-router-group-topk", "2"], ["--moe-router-group-topk", "not built"]),
    (["--moe-use-upcycling"], ["--moe-use-upcycling", "not built"]),
    (["--expert-tensor-parallel-size", "1"], ["--expert-tensor-parallel-size"]),
    (["--moe-token-dispatcher-type", "flex"], ["flex", "not built"]),
    (["--moe-router-load-balancing-type", "sinkhorn"], ["sinkhorn", "not built"]),
    (["--expert-model-parallel-size", "2"], ["expert parallelism: see #32 / moe-ep"]),
    (["--moe-router-enable-expert-bias"], ["--moe-router-score-function sigmoid"]),
    (["--moe-pad-expert-input-to-capacity"], ["--moe-expert-capacity-factor"]),
    (["--moe-router-topk", "5"], ["--moe-router-topk=5", "--num-experts=4"]),
    (["--moe-layer-freq", "([1]*3)"], ["--moe-layer-freq", "--num-layers=2"]),
    (["--moe-layer-freq", "__import__('os')"], ["--moe-layer-freq"]),
    (["--compile-layers"], ["--compile-layers"]),
    (["--moe-grouped-gemm", "--moe-ffn-hidden-size", "30"], ["--moe-grouped-gemm", "30"]),
    (["--moe-expert-capacity-factor", "0"], ["--moe-expert-capacity-factor must be positive"]),
])
def test_refused_by_name(extra, words):
    with pytest.raises(ConfigError) as error:
        _config(*extra)
    for word in words:
        assert word in str(error.value)


def test_tensor_parallel_needs_sequence_parallel_and_biases_are_refused():
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        _config("--tensor-model-parallel-size", "2", world_size=2)
    with pytest.raises(ConfigError, match="--disable-bias-linear"):
        validate_args(parse_args(flags_with("--num-experts", "4")), 1)
