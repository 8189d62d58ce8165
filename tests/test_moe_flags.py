"""The MoE flags (validation/moe.py): Megatron's names reach GPTConfig, --moe-layer-freq
becomes one flag per layer, and what megalite does not build is refused by name; where
--moe-grouped-gemm runs one kernel, torch's loop, or nothing (expert_parallel/grouped_gemm.py)."""

import pytest
import torch

from megalite.arguments import parse_args
from megalite.errors import ConfigError
from megalite.expert_parallel.grouped_gemm import (KERNEL, LOOP, check_grouped_gemm_device,
                                                   grouped_mm_path)
from megalite.parallel_state import ParallelState
from megalite.training import build_model
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
    grouped = _config("--num-experts", "8", "--moe-router-topk", "4",
                      "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
                      "--moe-router-topk-scaling-factor", "2.5").model
    assert (grouped.moe_router_num_groups, grouped.moe_router_group_topk,
            grouped.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    dense = validate_args(parse_args(flags_with()), 1).model
    assert dense.num_experts is None and dense.moe_layer_pattern is None


def test_layer_freq_as_megatron_reads_it():
    assert layer_pattern("1", 3) == (True, True, True)
    assert layer_pattern("3", 4) == (True, False, False, True)
    assert layer_pattern("([1]*3+[0]*1)", 4) == (True, True, True, False)
    assert layer_pattern("[0,1]", 2) == (False, True)


@pytest.mark.parametrize("extra, words", [
    (["--moe-router-group-topk", "2"], ["--moe-router-num-groups", "go together"]),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     ["--moe-router-num-groups=3", "--num-experts=4"]),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "3"],
     ["--moe-router-group-topk=3", "--moe-router-topk=2"]),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "1"],
     ["--moe-router-group-topk=1", "hold the top k"]),
    (["--moe-router-topk-scaling-factor", "0"], ["--moe-router-topk-scaling-factor must be"]),
    (["--moe-use-upcycling"], ["--moe-use-upcycling", "not built"]),
    (["--expert-tensor-parallel-size", "1"], ["--expert-tensor-parallel-size"]),
    (["--moe-token-dispatcher-type", "flex"], ["flex", "not built"]),
    (["--moe-router-load-balancing-type", "sinkhorn"], ["sinkhorn", "not built"]),
    (["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size=2 must divide"]),
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


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# aten's _grouped_mm in each release: torch 2.8's CUDA kernel checks
# _scaled_mm_allowed_device(sm90_only) and bf16 operands and raises otherwise, with no CPU
# kernel; from 2.9 _grouped_mm_cuda takes CUTLASS's kernel when
# _scaled_mm_allowed_device(sm90_only, sm100_only) (compute capability 9.x or 10.x) and all
# operands are bf16, and _grouped_mm_fallback (a loop over the groups after offs.cpu())
# otherwise, which is also the CPU's _grouped_mm.
@pytest.mark.parametrize("version, capability, dtype, path", [
    ("2.7.1", (9, 0), BF16, None),                      # no torch._grouped_mm
    ("2.8.0+cu128", (9, 0), BF16, KERNEL),              # H100, H200
    ("2.8.0", (10, 0), BF16, None),                     # B200
    ("2.8.0", (8, 0), BF16, None),                      # A100
    ("2.8.0", (9, 0), FP16, None),
    ("2.8.0", (9, 0), FP32, None),
    ("2.8.0", None, FP32, None),                        # CPU
    ("2.9.0", (9, 0), BF16, KERNEL),
    ("2.9.1", (10, 0), BF16, KERNEL),
    ("2.10.0", (10, 3), BF16, KERNEL),                  # GB300
    ("2.9.0", (8, 0), BF16, LOOP),
    ("2.9.0", (12, 0), BF16, LOOP),                     # RTX 50xx
    ("2.9.0", (9, 0), FP16, LOOP),
    ("2.13.0", (10, 0), FP32, LOOP),
    ("2.9.0", None, BF16, LOOP),
    ("2.13.0a0+git1234", None, FP32, LOOP),
])
def test_grouped_gemm_path_by_torch_device_and_dtype(version, capability, dtype, path):
    assert grouped_mm_path(version, capability, dtype) == path


def test_grouped_gemm_refused_where_torch_cannot_run_it(monkeypatch):
    """At the start of the run (training.build_model), by name: torch 2.8 on the CPU, or
    on an A100, would raise at the first MoE layer's forward."""
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    config = _config("--moe-grouped-gemm")
    with pytest.raises(ConfigError, match=r"--moe-grouped-gemm.*torch 2\.8\.0 on cpu"):
        build_model(config, ParallelState.single_process(), torch.device("cpu"), None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(ConfigError, match=r"torch 2\.8\.0 on cuda sm_80 in torch.bfloat16"):
        check_grouped_gemm_device(torch.device("cuda", 0), BF16)


def test_grouped_gemm_on_a_gpu_without_its_kernel_says_torch_loops(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.9.0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    note = check_grouped_gemm_device(torch.device("cuda", 0), BF16)
    assert "sm_80" in note and "one GEMM per expert after a host sync" in note
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert check_grouped_gemm_device(torch.device("cuda", 0), BF16) is None
    assert check_grouped_gemm_device(torch.device("cpu"), FP32) is None  # the CPU's only way
