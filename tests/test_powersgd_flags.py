"""--grad-compression and the --powersgd-* flags: they reach GradCompressionConfig with
torch's PowerSGDState defaults, say they are megalite's own, and bad values or layouts are
refused by name."""

import pytest
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from megalite.arguments import build_parser, parse_args
from megalite.errors import ConfigError
from megalite.validation import validate_args
from tests.helpers import flags_with


def config_of(*extra, world_size=2):
    return validate_args(parse_args(flags_with(*extra)), world_size).grad_compression


def test_flags_reach_the_config_with_torchs_defaults():
    c = config_of("--grad-compression", "powersgd")
    torch_state = PowerSGDState(None, start_powerSGD_iter=1000)
    assert c.enabled and c.rank == torch_state.matrix_approximation_rank
    assert (c.min_compression_rate, c.error_feedback, c.warm_start,
            c.orthogonalization_epsilon) == (torch_state.min_compression_rate,
                                             torch_state.use_error_feedback,
                                             torch_state.warm_start,
                                             torch_state.orthogonalization_epsilon)
    c = config_of("--grad-compression", "powersgd", "--powersgd-rank", "4",
                  "--powersgd-start-iter", "7", "--powersgd-min-compression-rate", "3",
                  "--no-powersgd-error-feedback", "--no-powersgd-warm-start",
                  "--powersgd-orthogonalization-epsilon", "1e-8")
    assert (c.rank, c.start_iter, c.min_compression_rate, c.error_feedback, c.warm_start,
            c.orthogonalization_epsilon) == (4, 7, 3.0, False, False, 1e-8)
    assert not config_of().enabled


def test_help_says_the_flags_are_megalites_own():
    text = build_parser().format_help().split("gradient compression (megalite's own", 1)[1]
    for flag in ("--grad-compression", "--powersgd-rank", "--powersgd-start-iter",
                 "--powersgd-min-compression-rate", "--no-powersgd-error-feedback",
                 "--no-powersgd-warm-start", "--powersgd-orthogonalization-epsilon"):
        help_text = text.split("  " + flag, 1)[1].split("\n  --", 1)[0]
        assert "Megalite's own" in " ".join(help_text.split()), flag


@pytest.mark.parametrize("extra, world_size, words", [
    (["--use-torch-fsdp2"], 2, ["--grad-compression powersgd", "--use-torch-fsdp2"]),
    ([], 1, ["--grad-compression powersgd", "DP x CP = 1"]),
    (["--fp16"], 2, ["--grad-compression powersgd", "--fp16"]),
    (["--powersgd-rank", "0"], 2, ["--powersgd-rank", ">= 1", "got 0"]),
    (["--powersgd-start-iter", "-1"], 2, ["--powersgd-start-iter", "got -1"]),
    (["--powersgd-min-compression-rate", "-1"], 2, ["--powersgd-min-compression-rate"]),
])
def test_bad_values_and_layouts_are_refused_by_name(extra, world_size, words):
    with pytest.raises(ConfigError) as err:
        config_of("--grad-compression", "powersgd", *extra, world_size=world_size)
    for word in words:
        assert word in str(err.value)
