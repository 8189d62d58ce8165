"""--use-torch-fsdp2, --data-parallel-sharding-strategy, --fsdp-grad-reduce-every-micro-batch
and --optimizer-cpu-offload: what they configure, the combinations refused up front, and the
torch they need."""

import re
from pathlib import Path

import pytest
from torch.distributed.fsdp import FSDPModule

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
    # Hybrid sharding replicates a sharded optimizer; plain DP has no shards.
    (["--num-distributed-optimizer-instances", "2"],
     ["--num-distributed-optimizer-instances=2", "--use-distributed-optimizer",
      "--use-torch-fsdp2"]),
    (["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "3"],
     ["--num-distributed-optimizer-instances=3 must divide", "= 2"]),
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


ROOT = Path(__file__).resolve().parents[1]
# The first torch release with each FSDPModule method megalite calls. The divide factor
# and the forced SUM came with pytorch PR #155915 ("Allow forcing FSDP2 to always use SUM
# reductions", June 2025), first released in torch 2.8.0; the gradient-sync switch is
# FSDP2's own, public in torch.distributed.fsdp since 2.6.
FSDP_METHODS_SINCE = {"set_gradient_divide_factor": (2, 8),
                      "set_force_sum_reduction_for_comms": (2, 8),
                      "set_requires_gradient_sync": (2, 6)}


def test_the_torch_floor_has_every_fsdp2_method_megalite_calls():
    """setup.py's and install.sh's torch floors agree, and are no older than the newest
    FSDPModule method called anywhere in megalite/ (each listed above with its release)."""
    methods = {n for n in dir(FSDPModule) if not n.startswith("_")}
    called = {name for path in (ROOT / "megalite").rglob("*.py")
              for name in re.findall(r"\.(\w+)\(", path.read_text()) if name in methods}
    assert called and called <= FSDP_METHODS_SINCE.keys(), called - FSDP_METHODS_SINCE.keys()
    setup = re.findall(r'"torch>=(\d+)\.(\d+)"', (ROOT / "setup.py").read_text())
    install = re.findall(r"\(major, minor\) >= \((\d+), (\d+)\)",
                         (ROOT / "install.sh").read_text())
    assert len(setup) == len(install) == 1, (setup, install)
    floor = tuple(map(int, setup[0]))
    assert floor == tuple(map(int, install[0]))
    assert floor >= max(FSDP_METHODS_SINCE[name] for name in called), floor
