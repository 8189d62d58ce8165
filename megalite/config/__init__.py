"""The frozen configuration `pretrain` hands to each part: `Config`, one dataclass per part
(its sections, one module each here), every field that a flag sets declaring that flag
(config/flags.py, docs/design.md §25). Every fact is stored once: the model's shape lives in
`GPTConfig` and nowhere else. megalite/validation/ builds these from the parsed flags and
derives what is derived (global batch, micro-batches, schedule lengths in samples, padded
vocabulary) there and only there.
"""

import enum
from dataclasses import dataclass

import torch

from megalite.config.checkpoint import CheckpointConfig
from megalite.config.model import GPTConfig
from megalite.config.monitoring import LoggingConfig, MonitoringConfig
from megalite.config.parallel import (DEFAULT_BUCKET_SIZE, DistributedConfig,  # noqa: F401
                                      GradCompressionConfig, ParallelConfig)
from megalite.config.training import (DataConfig, OptimizerConfig, PrecisionConfig,
                                      SchedulerConfig, TrainingConfig)

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
"""Short names (as Megatron's --bf16, --fp16) of the dtypes of parameters and gradients."""


class OptimizerKind(enum.Enum):
    """Which optimizer the flags ask for (`Config.optimizer_kind`), read by the
    optimizer builder, the memory planner and checkpointing."""
    FP32 = "fp32"
    """AdamW directly on fp32 parameters."""
    FP32_MAIN_PARAMS = "fp32_main_params"
    """fp32 main copies of bf16/fp16 parameters, not sharded."""
    SHARDED_FP32_MAIN_PARAMS = "sharded_fp32_main_params"
    """fp32 main copies and Adam moments sharded over DP (ZeRO-1)."""
    FULLY_SHARDED = "fully_sharded"
    """fp32 parameters sharded over DP by FSDP2 (ZeRO-2/3): each rank's shard is the main
    copy, its Adam moments beside it; bf16/fp16 copies only while gathered."""

    @property
    def has_main_params(self) -> bool:
        return self is not OptimizerKind.FP32

    @property
    def sharded(self) -> bool:
        """Optimizer state split over DP (one checkpoint file per DP rank)."""
        return self in (OptimizerKind.SHARDED_FP32_MAIN_PARAMS, OptimizerKind.FULLY_SHARDED)


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole run, one field per section: the parser and `from_flags` find each section's
    flags through these fields. The model-only configuration of the tools
    (validation.validate_model_args) has no optimizer, scheduler or data."""
    model: GPTConfig
    parallel: ParallelConfig
    training: TrainingConfig
    precision: PrecisionConfig
    logging: LoggingConfig
    distributed: DistributedConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    data: DataConfig | None = None
    monitoring: MonitoringConfig = MonitoringConfig()
    grad_compression: GradCompressionConfig = GradCompressionConfig()

    @property
    def optimizer_kind(self) -> OptimizerKind:
        """ZeRO-1 shards fp32 main parameters over DP (fp32 models too, as in Megatron);
        bf16/fp16 parameters get unsharded fp32 main copies; fp32 ones plain AdamW."""
        if self.parallel.use_torch_fsdp2:
            return OptimizerKind.FULLY_SHARDED
        if self.parallel.use_distributed_optimizer:
            return OptimizerKind.SHARDED_FP32_MAIN_PARAMS
        if self.precision.params_dtype != torch.float32:
            return OptimizerKind.FP32_MAIN_PARAMS
        return OptimizerKind.FP32

    def layers_compiled(self, device_type: str) -> bool:
        """Whether each transformer layer runs under torch.compile on a `device_type`
        ("cuda", "cpu") device: as --compile-layers / --no-compile-layers say, else
        compile_by_default. training.build_model builds it so and the memory planner plans
        it so: one decision, read in both places."""
        if self.model.compile_layers is not None:
            return self.model.compile_layers
        return compile_by_default(self, device_type)

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are accumulated and reduced over DP x CP in (the gradient
        buffer's; FSDP2's reduce_dtype): fp32 under --accumulate-allreduce-grads-in-fp32,
        else the parameters'."""
        if self.parallel.accumulate_allreduce_grads_in_fp32:
            return torch.float32
        return self.precision.params_dtype

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of grad_dtype."""
        return self.grad_dtype.itemsize



def compile_by_default(config: Config, device_type: str) -> bool:
    """--compile-layers when neither it nor --no-compile-layers is given. On a GPU eager
    layers spend as long on their elementwise work (norms, RoPE, SwiGLU, residual adds,
    casts: one memory pass each) as on their GEMMs, which compiling fuses away (37% -> 51%
    MFU, docs/benchmarks.md); a CPU gains little and would wait minutes for inductor's C++
    build. Only where compiled layers have run on a GPU: TP 1 and CP 1 (no collective
    inside a layer), dense layers (MoE's routed shapes change every step), not under FSDP2
    (its hooks around compiled layers have not run on a GPU), not under zb-h1, whose
    split backward a compiled layer does not make, and not with selective recompute, whose
    checkpoint inside the layer does not trace."""
    p = config.parallel
    return (device_type == "cuda" and p.tensor_model_parallel_size == 1
            and p.context_parallel_size == 1 and not config.model.num_experts
            and not p.use_torch_fsdp2 and p.pipeline_schedule != "zb-h1"
            and config.model.recompute_granularity != "selective")
