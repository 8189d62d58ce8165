"""Flag parsing and validation: Megatron's defaults, derived values, and every error."""

import subprocess
import sys

import pytest

from megalite.arguments import build_parser, parse_args
from megalite.config import OptimizerKind
from megalite.validation import pad_vocab_size, validate_args, validate_model_args
from megalite.errors import ConfigError

from tests.helpers import BASE_FLAGS, without


def config_of(*extra, world_size=1):
    return validate_args(parse_args(BASE_FLAGS + list(extra)), world_size)


def test_megatron_defaults():
    a = parse_args([])
    assert (a.attention_dropout, a.hidden_dropout, a.init_method_std) == (0.1, 0.1, 0.02)
    assert (a.make_vocab_size_divisible_by, a.seed, a.lr_decay_style) == (128, 1234, "linear")
    assert (a.weight_decay, a.adam_beta1, a.adam_beta2, a.adam_eps) == (0.01, 0.9, 0.999, 1e-8)
    assert (a.initial_loss_scale, a.min_loss_scale, a.loss_scale_window, a.hysteresis) == (
        2.0 ** 32, 1.0, 1000, 2)
    assert (a.log_interval, a.eval_interval, a.eval_iters, a.clip_grad) == (100, 1000, 100, 1.0)
    assert (a.position_embedding_type, a.normalization, a.norm_epsilon) == (
        "learned_absolute", "LayerNorm", 1e-5)
    assert a.add_bias_linear and not a.swiglu and a.rotary_base == 10000
    assert a.distributed_timeout_minutes == 10


def test_a_collective_timeout_may_be_a_fraction_of_a_minute():
    """A hung rank ends the job in seconds where a restart is cheap (tools/chaos.py runs
    its campaign at 0.25); Megatron-LM's flag takes whole minutes."""
    assert parse_args(["--distributed-timeout-minutes", "0.25"]).distributed_timeout_minutes \
        == 0.25


def test_help_is_grouped():
    text = build_parser().format_help()
    for group in ("model:", "parallelism:", "training:", "learning rate:", "mixed precision:",
                  "data:", "checkpointing:", "logging:", "distributed:"):
        assert group in text


def test_derived_defaults():
    c = config_of()
    m = c.model
    assert (m.ffn_hidden_size, m.kv_channels, m.num_query_groups) == (256, 16, 4)
    assert m.max_position_embeddings == 32 and m.padded_vocab_size == 64
    assert c.training.num_microbatches == 2
    # Megatron's SwiGLU default: 2/3 of 4h rounded down to a multiple of 64.
    assert config_of("--swiglu", "--hidden-size", "96").model.ffn_hidden_size == 256
    assert config_of("--global-batch-size", "4").training.num_microbatches == 1


def test_vocab_padding_closed_form():
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(50257, 128, 8) == 51200
    assert pad_vocab_size(64, 64, 1) == 64
    assert config_of("--vocab-size", "65").model.padded_vocab_size == 128


def test_train_samples_gives_iterations_and_sample_schedule():
    c = validate_args(parse_args(without(BASE_FLAGS, "--train-iters")
                                 + ["--train-samples", "100", "--lr-warmup-samples", "16"]))
    assert c.training.train_iters == 12  # 100 // 8
    assert (c.scheduler.warmup_steps, c.scheduler.decay_steps) == (16, 100)


def test_iteration_schedule_is_counted_in_samples():
    c = config_of("--lr-warmup-iters", "2", "--lr-decay-iters", "8")
    assert (c.scheduler.warmup_steps, c.scheduler.decay_steps) == (16, 64)
    c = config_of("--lr-warmup-fraction", "0.25")
    assert c.scheduler.warmup_steps == 20  # 0.25 x 10 iters x 8 samples


@pytest.mark.parametrize("extra, words", [
    (["--bf16", "--fp16"], ["--bf16", "--fp16"]),
    (["--global-batch-size", "6"], ["--global-batch-size=6", "--micro-batch-size=4"]),
    (["--num-attention-heads", "3"], ["--hidden-size=64", "--num-attention-heads=3"]),
    (["--group-query-attention", "--num-query-groups", "3"],
     ["--num-attention-heads=4", "--num-query-groups=3"]),
    (["--seq-length", "64", "--max-position-embeddings", "32"],
     ["--seq-length=64", "--max-position-embeddings=32"]),
    (["--train-samples", "80"], ["--train-iters", "--train-samples"]),
    (["--lr-warmup-iters", "10"], ["warm-up", "--lr-warmup"]),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], ["--lr-warmup-fraction"]),
    (["--lr-decay-style", "WSD"], ["WSD", "--lr-wsd-decay-iters"]),
    (["--lr-decay-samples", "40"], ["--lr-decay-samples", "--train-samples"]),
    (["--min-lr", "0.1"], ["--min-lr=0.1", "--lr=0.001"]),
    (["--lr", "-1"], ["--lr must be positive", "-1"]),
    (["--attention-dropout", "1.5"], ["--attention-dropout", "1.5"]),
    (["--adam-beta2", "1.0"], ["--adam-beta2", "1.0"]),
    (["--micro-batch-size", "0"], ["--micro-batch-size", "0"]),
    (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"],
     ["--min-loss-scale=8", "--initial-loss-scale=4"]),
    (["--hysteresis", "0"], ["--hysteresis=0"]),
    (["--position-embedding-type", "rope", "--kv-channels", "15"],
     ["--kv-channels=15", "even"]),
    (["--rotary-percent", "0"], ["--rotary-percent", "0"]),
    (["--vocab-size", "2"], ["--vocab-size", "2"]),
    (["--num-workers", "-1"], ["--num-workers", "-1"]),
    (["--exit-interval", "0"], ["--exit-interval", "0"]),
    (["--eval-iters", "-1"], ["--eval-iters", "-1"]),
])
def test_bad_combinations_name_flags_and_values(extra, words):
    with pytest.raises(ConfigError) as err:
        config_of(*extra)
    for word in words:
        assert word in str(err.value)


def test_missing_required_flags_are_named():
    with pytest.raises(ConfigError, match="--num-layers.*--lr|--lr.*--num-layers"):
        validate_args(parse_args(["--mock-data", "--vocab-size", "64", "--hidden-size", "8",
                                  "--num-attention-heads", "2", "--seq-length", "8",
                                  "--micro-batch-size", "1", "--train-iters", "1"]))


def test_exactly_one_data_source():
    flags = without(BASE_FLAGS, "--mock-data")
    with pytest.raises(ConfigError, match="--data-path.*--mock-data"):
        validate_args(parse_args(flags))
    with pytest.raises(ConfigError, match="--data-path.*--mock-data"):
        config_of("--data-path", "x")
    with pytest.raises(ConfigError, match="--data-path needs --tokenizer-type"):
        validate_args(parse_args(flags + ["--data-path", "x"]))


def test_tokenizer_vocabulary_sets_the_padded_vocab():
    flags = without(BASE_FLAGS, "--mock-data")
    c = validate_args(parse_args(flags + ["--data-path", "x", "--tokenizer-type",
                                          "NullTokenizer"]), 1, tokenizer_vocab_size=65)
    assert (c.model.vocab_size, c.model.padded_vocab_size) == (65, 128)
    assert c.data.data_path == ("x",)


def test_world_size_must_fit_the_grid():
    with pytest.raises(ConfigError, match="world size 3"):
        config_of("--tensor-model-parallel-size", "2", world_size=3)


@pytest.mark.parametrize("extra, message", [
    (["--save-interval", "5"], "--save-interval=5 needs --save"),
    (["--finetune"], "--finetune needs --load"),
    (["--save", "x", "--keep-last-n-checkpoints", "-1"], "--keep-last-n-checkpoints must be >= 0"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be positive"),
])
def test_checkpoint_flag_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        config_of(*extra)


def test_checkpoint_flags_reach_the_config():
    c = config_of("--save", "s", "--load", "l", "--save-interval", "10", "--no-save-optim",
                  "--no-load-rng", "--keep-last-n-checkpoints", "3", "--exit-signal-handler",
                  "--exit-duration-in-mins", "1.5", "--no-check-for-nan-in-loss-and-grad",
                  ).checkpoint
    assert (c.save, c.load, c.save_interval, c.save_optim, c.load_optim, c.load_rng,
            c.keep_last, c.exit_signal_handler, c.exit_duration_in_mins, c.check_for_nan) == (
        "s", "l", 10, False, True, False, 3, True, 1.5, False)


@pytest.mark.parametrize("extra", [
    ["--overlap-param-gather"],
    ["--overlap-param-gather", "--use-distributed-optimizer"],
    ["--overlap-param-gather", "--overlap-grad-reduce"],
])
def test_overlap_param_gather_needs_zero_and_overlapped_reduction(extra):
    with pytest.raises(ConfigError, match="--overlap-param-gather needs "
                                          "--use-distributed-optimizer and --overlap-grad-reduce"):
        config_of(*extra)


def test_data_parallel_flags_reach_the_config():
    p = config_of("--use-distributed-optimizer", "--overlap-grad-reduce",
                  "--overlap-param-gather", "--accumulate-allreduce-grads-in-fp32",
                  "--ddp-bucket-size", "1000").parallel
    assert (p.use_distributed_optimizer, p.overlap_grad_reduce, p.overlap_param_gather,
            p.accumulate_allreduce_grads_in_fp32, p.ddp_bucket_size) == (True, True, True,
                                                                         True, 1000)


@pytest.mark.parametrize("extra, words", [
    (["--pipeline-model-parallel-size", "4", "--num-layers", "6"],
     ["--num-layers=6", "--pipeline-model-parallel-size=4"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4",
      "--num-layers-per-virtual-pipeline-stage", "3"],
     ["--num-layers=4", "--num-layers-per-virtual-pipeline-stage=3"]),
    (["--pipeline-model-parallel-size", "4", "--num-layers", "8",
      "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8",
      "--micro-batch-size", "4"],
     ["--global-batch-size / (--micro-batch-size x DP)", "--pipeline-model-parallel-size"]),
    (["--num-layers-per-virtual-pipeline-stage", "1"],
     ["--num-layers-per-virtual-pipeline-stage", "--pipeline-model-parallel-size"]),
])
def test_pipeline_layout_errors(extra, words):
    world = 4 if "4" in extra[:2] else 2 if "2" in extra[:2] else 1
    with pytest.raises(ConfigError) as err:
        config_of(*extra, world_size=world)
    for word in words:
        assert word in str(err.value)


def test_virtual_pipeline_chunks():
    c = config_of("--pipeline-model-parallel-size", "2", "--num-layers", "8",
                  "--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "1",
                  world_size=2)
    assert c.parallel.virtual_pipeline_model_parallel_size == 2
    assert c.training.num_microbatches == 8


@pytest.mark.parametrize("extra, words", [
    (["--num-attention-heads", "2", "--tensor-model-parallel-size", "4"],
     ["--tensor-model-parallel-size=4", "--num-attention-heads=2"]),
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"],
     ["--tensor-model-parallel-size=4", "query groups (2"]),
    (["--ffn-hidden-size", "30", "--tensor-model-parallel-size", "4"],
     ["--ffn-hidden-size=30", "--tensor-model-parallel-size=4"]),
    (["--sequence-parallel", "--seq-length", "30", "--tensor-model-parallel-size", "4"],
     ["--seq-length=30", "--tensor-model-parallel-size=4"]),
    (["--use-flash-attn", "--attention-backend", "unfused"],
     ["--use-flash-attn", "--attention-backend unfused"]),
])
def test_tensor_parallel_splits_must_divide(extra, words):
    with pytest.raises(ConfigError) as err:
        config_of(*extra, world_size=4 if "--tensor-model-parallel-size" in extra else 1)
    for word in words:
        assert word in str(err.value)


def test_tensor_parallel_config():
    c = config_of("--tensor-model-parallel-size", "4", "--sequence-parallel", world_size=4)
    assert c.parallel.tensor_model_parallel_size == 4 and c.model.sequence_parallel
    assert c.model.padded_vocab_size == 256 and c.model.vocab_size == 64
    # At TP 1 sequence parallelism is the identity and is switched off.
    assert not config_of("--sequence-parallel").model.sequence_parallel
    assert config_of("--use-flash-attn").model.attention_backend == "flash"


def test_data_parallel_size_is_inferred():
    c = config_of("--tensor-model-parallel-size", "2", world_size=4)
    assert c.parallel.data_parallel_size == 2
    assert c.training.num_microbatches == 1  # global batch 8 = micro-batch 4 x DP 2
    with pytest.raises(ConfigError, match="--global-batch-size=8.*data-parallel size 4"):
        config_of(world_size=4)


def test_config_is_frozen():
    c = config_of()
    with pytest.raises(AttributeError):
        c.training.train_iters = 5


@pytest.mark.slow
def test_entry_script_exits_nonzero_with_message(tmp_path):
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *BASE_FLAGS, "--bf16", "--fp16"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--bf16 and --fp16" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra, message", [
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"],
     "apply to --recompute-granularity full only"),
    (["--recompute-method", "block"], "apply to --recompute-granularity full only"),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "0"], "--recompute-num-layers must be positive"),
    (["--recompute-granularity", "selective", "--compile-layers"],
     "--compile-layers cannot trace"),
])
def test_recompute_flag_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        config_of(*extra)


def test_recompute_flags_reach_the_model_config():
    m = config_of("--recompute-granularity", "full", "--recompute-method", "block",
                  "--recompute-num-layers", "2").model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == (
        "full", "block", 2)


def test_unset_global_batch_is_micro_batch_times_dp_everywhere():
    """Issue 12: the global batch is derived once; the run length and the schedule,
    counted in samples, use that one value."""
    flags = without(BASE_FLAGS, "--global-batch-size")
    c = validate_args(parse_args(flags + ["--lr-warmup-iters", "2"]), 4)
    assert (c.training.global_batch_size, c.training.num_microbatches) == (16, 1)
    assert (c.training.train_iters, c.training.train_samples) == (10, 160)
    assert (c.scheduler.warmup_steps, c.scheduler.decay_steps) == (32, 160)
    c = validate_args(parse_args(without(flags, "--train-iters")
                                 + ["--train-samples", "100"]), 2)
    assert (c.training.global_batch_size, c.training.train_iters) == (8, 12)
    assert (c.training.train_samples, c.scheduler.decay_steps) == (100, 100)


def test_bf16_accumulates_and_reduces_gradients_in_fp32():
    """As Megatron: --bf16 forces --accumulate-allreduce-grads-in-fp32."""
    assert config_of("--bf16").parallel.accumulate_allreduce_grads_in_fp32
    assert not config_of().parallel.accumulate_allreduce_grads_in_fp32
    assert not config_of("--fp16").parallel.accumulate_allreduce_grads_in_fp32
    assert config_of("--fp16", "--accumulate-allreduce-grads-in-fp32"
                     ).parallel.accumulate_allreduce_grads_in_fp32


@pytest.mark.parametrize("extra, kind", [
    ([], OptimizerKind.FP32),
    (["--bf16"], OptimizerKind.FP32_MAIN_PARAMS),
    (["--fp16"], OptimizerKind.FP32_MAIN_PARAMS),
    (["--use-distributed-optimizer"], OptimizerKind.SHARDED_FP32_MAIN_PARAMS),
    (["--bf16", "--use-distributed-optimizer"], OptimizerKind.SHARDED_FP32_MAIN_PARAMS),
])
def test_optimizer_kind(extra, kind):
    assert config_of(*extra).optimizer_kind is kind


@pytest.mark.parametrize("extra, kv", [
    (["--kv-channels", "264"], 264),
    (["--kv-channels", "12"], 12),
    (["--hidden-size", "72", "--num-attention-heads", "4"], 18),
])
def test_flash_attention_head_size(extra, kv):
    with pytest.raises(ConfigError) as err:
        config_of("--attention-backend", "flash", *extra)
    for word in ("--attention-backend flash", "--kv-channels", "<= 256", "multiple of 8",
                 f"got {kv}"):
        assert word in str(err.value)
    assert config_of("--use-flash-attn", "--kv-channels", "256").model.attention_backend == "flash"


MODEL_ONLY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--vocab-size", "64"]


def test_model_only_validation_needs_no_training_flags():
    c = validate_model_args(parse_args(MODEL_ONLY + ["--tensor-model-parallel-size", "2",
                                                     "--micro-batch-size", "2"]), 4)
    assert (c.optimizer, c.scheduler, c.data, c.training.train_iters) == (None,) * 4
    assert (c.parallel.data_parallel_size, c.training.global_batch_size) == (2, 4)
    assert c.model.padded_vocab_size == 256  # 64 padded to a multiple of 128 x TP 2
    # Generation: one sequence per micro-batch.
    assert validate_model_args(parse_args(MODEL_ONLY)).training.micro_batch_size == 1


@pytest.mark.parametrize("extra, words", [
    (["--num-attention-heads", "3"], ["--hidden-size=64", "--num-attention-heads=3"]),
    (["--vocab-size", "1"], ["--vocab-size=1"]),
    (["--tensor-model-parallel-size", "8"], ["--tensor-model-parallel-size=8"]),
])
def test_model_only_validation_refuses_bad_model_flags_by_name(extra, words):
    with pytest.raises(ConfigError) as err:
        validate_model_args(parse_args(MODEL_ONLY + extra), 8)
    for word in words:
        assert word in str(err.value)
    with pytest.raises(ConfigError, match="missing required flag.*--num-layers"):
        validate_model_args(parse_args(MODEL_ONLY[2:]))


# Megatron's own kernel and implementation switches, as its example launch scripts pass them
# (examples/gpt3, examples/llama: local implementation, its fusions off, Apex absent).
MEGATRON_SCRIPT_FLAGS = ["--transformer-impl", "local", "--no-masked-softmax-fusion",
                         "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
                         "--no-bias-dropout-fusion", "--no-rope-fusion",
                         "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
                         "--attention-softmax-in-fp32", "--use-mcore-models"]


def test_megatron_kernel_switches_run_as_written_and_change_nothing():
    """A Megatron launch script's kernel switches parse, and the model they give is the
    model without them."""
    assert config_of(*MEGATRON_SCRIPT_FLAGS) == config_of()
    assert config_of("--transformer-impl", "transformer_engine") == config_of()


def test_cross_entropy_loss_fusion_reaches_the_model_config():
    assert config_of("--cross-entropy-loss-fusion").model.cross_entropy_loss_fusion
    assert not config_of().model.cross_entropy_loss_fusion


def test_transformer_engine_cross_entropy_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE_FLAGS + ["--cross-entropy-fusion-impl", "te"])
    assert "--cross-entropy-fusion-impl" in capsys.readouterr().err
