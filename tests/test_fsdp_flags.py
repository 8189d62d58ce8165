"""--use-torch-fsdp2, --data-parallel-sharding-strategy, --fsdp-grad-reduce-every-micro-batch
and --optimizer-cpu-offload: what they configure, and the combinations refused up front."""

import pytest

from megalite.arguments import parse_args
from megalite.config import OptimizerKind
from megalite.errors import ConfigError
from megalite.validation import validate_args

from tests.helpers import BASE_FLAGS


def config(*extra, world_size=2):
    return validate_args(parse_args([*BASE_FLAGS, *extra]), world_size)


def test_fsdp_defaults_to_zero3_and_shards_the_optimizer():
    c = config("--use-torch-fsdp2")
    assert c.parallel.use_torch_fsdp2 and not c.parallel.optimizer_cpu_offload
    assert c.parallel.data_parallel_sharding_strategy == "optim_grads_params"
    assert not c.parallel.fsdp_grad_reduce_every_micro_batch
    assert config("--use-torch-fsdp2", "--fsdp-grad-reduce-every-micro-batch").parallel \
        .fsdp_grad_reduce_every_micro_batch
    assert c.optimizer_kind is OptimizerKind.FULLY_SHARDED and c.optimizer_kind.sharded
    zero2 = config("--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads",
                   "--optimizer-cpu-offload", "--bf16")
    assert zero2.parallel.data_parallel_sharding_strategy == "optim_grads"
    assert zero2.parallel.optimizer_cpu_offload
    assert zero2.parallel.accumulate_allreduce_grads_in_fp32
    assert config().optimizer_kind is OptimizerKind.FP32
    assert config("--use-distributed-optimizer", "--optimizer-cpu-offload").parallel \
        .optimizer_cpu_offload


@pytest.mark.parametrize("extra, words", [
    (["--use-torch-fsdp2", "--use-distributed-optimizer"],
     ["--use-torch-fsdp2", "--use-distributed-optimizer"]),
    (["--use-torch-fsdp2", "--overlap-grad-reduce", "--overlap-param-gather"],
     ["--overlap-param-gather", "prefetches"]),
    (["--optimizer-cpu-offload"], ["--optimizer-cpu-offload", "--use-torch-fsdp2",
                                   "--use-distributed-optimizer"]),
    # A deferred W pass runs after FSDP2 has reduce-scattered the layer's gradients.
    (["--use-torch-fsdp2", "--pipeline-schedule", "zb-h1"],
     ["--pipeline-schedule zb-h1", "--use-torch-fsdp2"]),
    # Plain DP and ZeRO-1 have no per-micro-batch reduce-scatter to turn on.
    (["--use-distributed-optimizer", "--fsdp-grad-reduce-every-micro-batch"],
     ["--fsdp-grad-reduce-every-micro-batch", "--use-torch-fsdp2"]),
    # No parameter is replicated over DP under FSDP2.
    (["--use-torch-fsdp2", "--check-weight-hash-across-dp-replicas-interval", "5"],
     ["--check-weight-hash-across-dp-replicas-interval", "--use-torch-fsdp2"]),
])
def test_refused_combinations_name_the_flags(extra, words):
    with pytest.raises(ConfigError) as err:
        config(*extra)
    for word in words:
        assert word in str(err.value)


def test_unknown_strategy_is_refused():
    with pytest.raises(SystemExit):
        parse_args([*BASE_FLAGS, "--data-parallel-sharding-strategy", "optim"])
