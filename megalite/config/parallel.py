"""The parallel layout (ParallelConfig), the process group's backend (DistributedConfig) and
PowerSGD on the data-parallel reduction (GradCompressionConfig), each field with its flag."""

from dataclasses import dataclass

from megalite.config.flags import flag
from megalite.parallel_state import RankGrid

DEFAULT_BUCKET_SIZE = 40_000_000
"""Elements per data-parallel gradient bucket when --ddp-bucket-size is unset (Megatron's
default): parameters are cut, in order, into buckets of at most this many elements of one
dtype, so a model of thousands of tensors costs a handful of collectives per step."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    GROUP = "parallelism"

    tensor_model_parallel_size: int = flag(
        1, help="TP: ranks each layer's weights are split over.")
    pipeline_model_parallel_size: int = flag(1, help="PP: pipeline stages.")
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank, None without interleaving (derived from
    --num-layers-per-virtual-pipeline-stage)."""
    pipeline_layer_counts: tuple[int, ...] | None = None
    """Layers of each global pipeline stage (chunk c of rank r is stage c*p + r), None for
    the even split (derived from --decoder-first/last-pipeline-num-layers and
    --account-for-embedding/loss-in-pipeline-split: stages.stage_layer_counts)."""
    data_parallel_size: int = 1
    """DP: world size / (TP x CP x PP) (derived)."""
    use_distributed_optimizer: bool = flag(
        False, help="ZeRO-1: shard optimizer state across data-parallel ranks.")
    ddp_bucket_size: int = flag(
        DEFAULT_BUCKET_SIZE, unset=None,
        help="Elements per data-parallel gradient all-reduce (default 40M).")
    overlap_grad_reduce: bool = flag(
        False, help="Reduce each gradient bucket as soon as backward completes it.")
    overlap_param_gather: bool = flag(
        False, help="ZeRO-1: all-gather updated parameters during the next forward.")
    # Megatron forces it under --bf16 (validation/layout.py).
    accumulate_allreduce_grads_in_fp32: bool = flag(
        False, help="Accumulate and reduce fp16 gradients in an fp32 buffer (always on with "
                    "--bf16, as in Megatron).")
    pipeline_schedule: str = flag(
        "1f1b", choices=["1f1b", "gpipe", "zb-h1"],
        help="Pipeline schedule, with p stages, m micro-batches per step and F, B, W the times "
             "of a stage's forward, input-gradient and weight-gradient passes. 1f1b (Megatron's; "
             "interleaved with --num-layers-per-virtual-pipeline-stage): bubble (p-1)/m, "
             "(p-1)/(v m) interleaved; the first stage holds the activations of p "
             "micro-batches. gpipe: all forwards, then all backwards; bubble (p-1)/m, "
             "activations of all m micro-batches. zb-h1 (zero bubble, Qi et al. 2024): 1F1B "
             "with each backward split into B and W, the Ws deferred into 1F1B's idle time; "
             "bubble (p-1)(F+B-W)/(m(F+B+W)), a third of 1F1B's when F = B = W; at most p "
             "micro-batches in flight on every stage (the first as in 1F1B), each deferred W "
             "keeping its linear layers' inputs and output gradients. gpipe and zb-h1 go "
             "beyond Megatron-LM (megalite's own choices) and run one model chunk per stage "
             "(no interleaving).")
    context_parallel_size: int = flag(
        1, help="CP: split each sequence over this many ranks (2 x CP load-balanced chunks; "
                "--seq-length must divide by 2 x CP).")
    use_torch_fsdp2: bool = flag(
        False, group="fsdp", help="Shard parameters, gradients and optimizer state over "
                                  "data-parallel ranks with torch's FSDP2 (fully_shard per "
                                  "transformer layer). Unlike Megatron, megalite composes it with "
                                  "TP, PP (also interleaved, tied embeddings), fp16, and loads "
                                  "any checkpoint layout.")
    data_parallel_sharding_strategy: str = flag(
        "optim_grads_params", group="fsdp", choices=["optim_grads", "optim_grads_params"],
        help="With --use-torch-fsdp2: optim_grads = ZeRO-2 (parameters kept gathered from "
             "forward to backward), optim_grads_params = ZeRO-3.")
    optimizer_cpu_offload: bool = flag(
        False, group="fsdp", help="fp32 main parameters and Adam moments in host memory, the "
                                  "optimizer step on the host: with --use-torch-fsdp2 or "
                                  "--use-distributed-optimizer (this rank's shard).")
    fsdp_grad_reduce_every_micro_batch: bool = flag(
        False, group="fsdp", help="With --use-torch-fsdp2 and several micro-batches per step: "
                                  "reduce-scatter the gradients after every micro-batch's "
                                  "backward into the sharded gradients (as Megatron-FSDP does), "
                                  "so no rank holds its model's whole gradients; m "
                                  "reduce-scatters per step for m micro-batches. Default: "
                                  "gradients accumulated unsharded, reduced once after the last "
                                  "micro-batch (megalite's option, beyond Megatron).")
    expert_model_parallel_size: int = flag(
        1, group="moe", help="EP: ranks the routed experts are split over.")
    num_distributed_optimizer_instances: int = flag(
        1, help="Hybrid sharding: split the data-parallel (x context-parallel) ranks into this "
                "many replicas of consecutive ranks; --use-distributed-optimizer or "
                "--use-torch-fsdp2 (HSDP) then shard within a replica and all-reduce the "
                "gradient shards across replicas. Megalite, beyond Megatron-LM, also splits "
                "the expert-data-parallel ranks the same way.")

    @property
    def grid(self) -> RankGrid:
        """The rank grid of these sizes (its groups, `dp_cp_size`), for `ParallelState`."""
        tp, pp, cp = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                      self.context_parallel_size)
        return RankGrid(tp * pp * cp * self.data_parallel_size, tp, pp, cp,
                        self.expert_model_parallel_size,
                        self.num_distributed_optimizer_instances)


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    GROUP = "distributed"

    backend: str | None = flag(
        None, "--distributed-backend", choices=["nccl", "gloo"],
        help="Default: nccl when an accelerator is visible, else gloo.")
    timeout_minutes: float = flag(
        10, "--distributed-timeout-minutes",
        help="How long a collective (and the start-up rendezvous) waits for the other ranks "
             "before it fails; a rank whose training made no progress for twice this is "
             "ended (megalite's watchdog). megalite takes fractions (0.25: 15 s), where "
             "Megatron-LM takes whole minutes.")


@dataclass(frozen=True, kw_only=True)
class GradCompressionConfig:
    """PowerSGD on the DP x CP gradient reduction (Vogels et al. 2019; megalite's own flags,
    named after torch's PowerSGDState fields: distributed/powersgd.py)."""
    GROUP = "grad_compression"

    kind: str = flag(
        "none", "--grad-compression", choices=["none", "powersgd"],
        help="Megalite's own. powersgd: low-rank DP x CP gradient reduction (Vogels et al. "
             "2019; docs/design.md). Not with --use-torch-fsdp2, --fp16.")
    rank: int = flag(1, "--powersgd-rank", help="Megalite's own (torch: "
                                                "matrix_approximation_rank). Columns of P and Q.")
    start_iter: int = flag(
        1000, "--powersgd-start-iter",
        help="Megalite's own (torch: start_powerSGD_iter). Steps reduced uncompressed before "
             "compression starts.")
    min_compression_rate: float = flag(
        2.0, "--powersgd-min-compression-rate",
        help="Megalite's own (torch: min_compression_rate). A matrix n x m is compressed only "
             "if n*m > rate*(n+m)*rank; smaller matrices and vectors are reduced as they are.")
    error_feedback: bool = flag(
        True, "--no-powersgd-error-feedback",
        help="Megalite's own (torch: use_error_feedback=False). Drop the compression error "
             "instead of adding it to the next gradient.")
    warm_start: bool = flag(
        True, "--no-powersgd-warm-start",
        help="Megalite's own (torch: warm_start=False). Draw a new random Q every step instead "
             "of reusing the last one.")
    orthogonalization_epsilon: float = flag(
        0.0, "--powersgd-orthogonalization-epsilon",
        help="Megalite's own (torch: orthogonalization_epsilon). Added to column norms when "
             "orthogonalising; > 0 guards all-zero gradient matrices.")

    @property
    def enabled(self) -> bool:
        return self.kind == "powersgd"
