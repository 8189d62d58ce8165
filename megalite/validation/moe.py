"""The mixture-of-experts flags (issue 32; docs/design.md "Mixture of experts"): the GPTConfig
fields derived from them (`moe_model_fields`), and what megalite refuses by name: Megatron's
MoE features it does not build and the combinations that cannot work."""

import re
from dataclasses import dataclass, fields, make_dataclass

from megalite.config import ParallelConfig
from megalite.config.flags import flag, flag_name
from megalite.errors import ConfigError
from megalite.validation.checks import check_positive
from megalite.validation.expert_parallel import check_expert_parallel


@dataclass(frozen=True)
class MoeFlags:
    GROUP = "moe"

    moe_layer_freq: str = flag(
        "1", help="Which layers are MoE: an int N (every Nth layer, from layer 0) or a Python "
                  "list expression of 0/1 per layer, e.g. \"([1]*3+[0]*1)\" (Megatron's).")


# Megatron's MoE flags that megalite parses only to refuse them by name.
RefusedMoeFlags = make_dataclass("RefusedMoeFlags", [
    (name, object, flag(None, nargs="?", const=True, metavar="X",
                        help="Megatron's; not built in megalite (refused)."))
    for name in ("expert_tensor_parallel_size", "moe_use_upcycling",
                 "moe_router_dtype", "moe_input_jitter_eps",
                 "moe_layer_recompute", "moe_shared_expert_overlap", "moe_permute_fusion",
                 "moe_router_fusion", "moe_enable_deepep", "moe_extended_tp",
                 "moe_use_legacy_grouped_gemm", "moe_per_layer_logging")],
    namespace={"GROUP": "moe"}, frozen=True)

# torch._grouped_mm needs every operand's rows 16-byte aligned (checked in torch 2.13 on CPU).
_GROUPED_MM_ALIGNMENT_BYTES = 16


def moe_model_fields(args, parallel: ParallelConfig, ffn_hidden_size: int) -> dict:
    """GPTConfig's derived MoE fields (moe_ffn_hidden_size, moe_layer_pattern), after the
    checks; a dense model gets None for both. Raises ConfigError."""
    _refuse_unbuilt(args)
    if args.num_experts is None:
        if parallel.expert_model_parallel_size != 1:
            raise ConfigError(f"--expert-model-parallel-size="
                              f"{parallel.expert_model_parallel_size} needs --num-experts")
        return dict(moe_ffn_hidden_size=None, moe_layer_pattern=None)
    check_positive(args, "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                   "moe_shared_expert_intermediate_size", "moe_expert_capacity_factor",
                   "moe_router_bias_update_rate", "expert_model_parallel_size")
    if args.moe_router_topk > args.num_experts:
        raise ConfigError(f"--moe-router-topk={args.moe_router_topk} exceeds "
                          f"--num-experts={args.num_experts}")
    _check_layout(args, parallel)
    _check_router(args)
    ffn = args.moe_ffn_hidden_size or ffn_hidden_size
    _check_widths(args, parallel, ffn)
    return dict(moe_ffn_hidden_size=ffn, moe_layer_pattern=layer_pattern(args.moe_layer_freq,
                                                                         args.num_layers))


def layer_pattern(freq: str, num_layers: int) -> tuple[bool, ...]:
    """--moe-layer-freq as Megatron reads it: an int N makes layers 0, N, 2N, ... MoE; a list
    expression of 0/1 per layer (e.g. "([1]*3+[0]*1)") names each layer."""
    text = str(freq).strip()
    if re.fullmatch(r"\d+", text):
        n = int(text)
        if n <= 0:
            raise ConfigError(f"--moe-layer-freq must be positive, got {n}")
        return tuple(i % n == 0 for i in range(num_layers))
    if not re.fullmatch(r"[\[\]\(\)0-9*+,\s]+", text):
        raise ConfigError(f"--moe-layer-freq={freq!r}: expected an int or a list expression "
                          "of 0/1 such as \"([1]*3+[0]*1)\"")
    try:
        values = eval(text, {"__builtins__": {}}, {})  # digits, brackets, * + , only
    except Exception as error:
        raise ConfigError(f"--moe-layer-freq={freq!r} does not evaluate: {error}") from None
    values = list(values) if isinstance(values, (list, tuple)) else None
    if values is None or len(values) != num_layers or set(values) - {0, 1}:
        raise ConfigError(f"--moe-layer-freq={freq!r} must give one 0 or 1 per layer "
                          f"(--num-layers={num_layers}), got {values}")
    return tuple(bool(v) for v in values)


def _refuse_unbuilt(args):
    for name in (f.name for f in fields(RefusedMoeFlags)):
        if getattr(args, name, None) is not None:
            raise ConfigError(f"{flag_name(name)} is Megatron's and not built in megalite "
                              "(issue 32)")
    if args.moe_router_load_balancing_type == "sinkhorn":
        raise ConfigError("--moe-router-load-balancing-type sinkhorn is Megatron's and not "
                          "built in megalite: use aux_loss, seq_aux_loss or none")
    if args.moe_token_dispatcher_type == "flex":
        raise ConfigError("--moe-token-dispatcher-type flex (DeepEP) is Megatron's and not "
                          "built in megalite: use allgather or alltoall")


def _check_layout(args, parallel: ParallelConfig):
    ep, tp = parallel.expert_model_parallel_size, parallel.tensor_model_parallel_size
    if ep > 1:
        check_expert_parallel(args, parallel)
    if args.num_experts % ep:
        raise ConfigError(f"--num-experts={args.num_experts} is not divisible by "
                          f"--expert-model-parallel-size={ep}")
    if tp > 1 and not args.sequence_parallel:
        # Megatron's rule too: the MoE layer all-gathers the sequence over TP like the
        # column-parallel layers do under SP.
        raise ConfigError(f"--num-experts with --tensor-model-parallel-size={tp} needs "
                          "--sequence-parallel")
    if args.add_bias_linear:
        raise ConfigError("--num-experts: experts have no biases; pass --disable-bias-linear")
    if args.compile_layers:
        # Tokens per expert change every step: a compiled layer would recompile or break
        # its graph at the dispatch.
        raise ConfigError("--compile-layers is not supported with --num-experts")
    if args.fp8_format is not None:
        raise ConfigError("--fp8-format is not supported with --num-experts (the expert "
                          "GEMMs have no FP8 path)")
    if args.moe_expert_capacity_factor is not None and parallel.context_parallel_size > 1:
        raise ConfigError("--moe-expert-capacity-factor with --context-parallel-size > 1 is "
                          "not supported: capacity would count each CP rank's chunk of the "
                          "sequence, not the sequence one process routes")


def _check_router(args):
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if (getattr(args, name) or 0.0) < 0:
            raise ConfigError(f"{flag_name(name)} must be >= 0, got {getattr(args, name)}")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        # As Megatron: the bias shifts scores in [0, 1]; a softmax's would not stay comparable.
        raise ConfigError("--moe-router-enable-expert-bias needs --moe-router-score-function "
                          "sigmoid")
    if args.moe_router_pre_softmax and args.moe_router_score_function != "softmax":
        raise ConfigError("--moe-router-pre-softmax applies to --moe-router-score-function "
                          "softmax only")
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs "
                          "--moe-expert-capacity-factor")
    check_positive(args, "moe_router_topk_scaling_factor")
    check_groups(args)


def check_groups(args):
    """Group-limited routing: groups of whole experts, enough of them chosen for the top k,
    each scored by at least its best expert (k // group_topk)."""
    groups, top = args.moe_router_num_groups, args.moe_router_group_topk
    if (groups is None) != (top is None):
        raise ConfigError("--moe-router-num-groups and --moe-router-group-topk go together "
                          f"(got {groups} and {top})")
    if groups is None:
        return
    check_positive(args, "moe_router_num_groups", "moe_router_group_topk")
    k, experts = args.moe_router_topk, args.num_experts
    if experts % groups:
        raise ConfigError(f"--moe-router-num-groups={groups} does not divide "
                          f"--num-experts={experts}")
    if top > groups or top > k or k > top * (experts // groups):
        raise ConfigError(f"--moe-router-group-topk={top} must be at most "
                          f"--moe-router-num-groups={groups} and --moe-router-topk={k}, and "
                          f"its groups ({experts // groups} experts each) must hold the top k")


def _check_widths(args, parallel: ParallelConfig, ffn: int):
    tp = parallel.tensor_model_parallel_size
    widths = {"--moe-ffn-hidden-size (default --ffn-hidden-size)": ffn,
              "--moe-shared-expert-intermediate-size": args.moe_shared_expert_intermediate_size}
    for name, width in widths.items():
        if width is not None and width % tp:
            raise ConfigError(f"{name}={width} is not divisible by "
                              f"--tensor-model-parallel-size={tp}")
    if args.moe_grouped_gemm:
        itemsize = 2 if (args.bf16 or args.fp16) else 4
        multiple = _GROUPED_MM_ALIGNMENT_BYTES // itemsize
        if args.hidden_size % multiple or (ffn // tp) % multiple:
            raise ConfigError(f"--moe-grouped-gemm (torch._grouped_mm) needs --hidden-size="
                              f"{args.hidden_size} and --moe-ffn-hidden-size / TP = "
                              f"{ffn // tp} to be multiples of {multiple} in this dtype "
                              "(16-byte rows)")
