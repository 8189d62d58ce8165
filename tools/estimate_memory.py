"""Per-GPU memory of a training run, planned from pretrain_gpt.py's flags (issue 8).

Pass the model, parallel-layout, precision and batch flags of pretrain_gpt.py, plus the
world size (training flags such as --lr, --train-iters or a data source are accepted, so
a training command line can be reused, and not needed):

    python tools/estimate_memory.py --world-size 8 --gpu-memory-gib 80 \\
        --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer \\
        --bf16 --num-layers 32 --hidden-size 4096 ... --vocab-size 32000 \\
        --micro-batch-size 1 --global-batch-size 256

The flags go through megalite's own model validation (a model or layout pretrain_gpt.py
would refuse is refused here, exit status 2). The table has one row per pipeline rank: bytes
of parameters, gradient buffer, optimizer state (fp32 main parameters and Adam moments),
the fp32 gradient copies the optimizer step makes, and the activations at the peak of
the step (micro-batches in flight in parentheses), in GiB, and the total as a fraction
of the GPU. See docs/memory.md for what each column counts. With
--data-path and a tokenizer, the tokenizer's files are read for the vocabulary size,
unless --tokenizer-vocab-size gives it.
"""

import argparse
import sys

from megalite.arguments import parse_args
from megalite.config import DTYPE_NAMES, Config
from megalite.errors import ConfigError, MegaliteError
from megalite.memory_estimate import DEVICES, GiB, RankMemory, estimate_memory, num_model_parameters
from megalite.memory_estimate.moe import dispatched_rows, expert_weights
from megalite.memory_estimate.weights import rank_parameters
from megalite.validation import validate_model_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Every other flag is pretrain_gpt.py's (python pretrain_gpt.py --help).")
    parser.add_argument("--world-size", type=int, required=True,
                        help="GPUs in the run (TP x PP x DP).")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="Memory of one GPU, to say whether the plan fits (default 80).")
    parser.add_argument("--device", choices=sorted(DEVICES), default="cuda",
                        help="Whose kernels' saved tensors to model (default cuda).")
    parser.add_argument("--tokenizer-vocab-size", type=int, default=None,
                        help="The tokenizer's vocabulary size, instead of reading its files.")
    return parser


def load_config(tool_args, train_argv: list[str]) -> Config:
    """Validate the model, layout and batch flags as pretrain_gpt.py does. Raises
    MegaliteError."""
    args = parse_args(train_argv)
    if args.micro_batch_size is None:
        raise ConfigError("missing required flag(s): --micro-batch-size (activations are "
                          "planned per micro-batch)")
    vocab = tool_args.tokenizer_vocab_size
    if vocab is None and args.tokenizer_type is not None:
        from megalite.data.tokenizer import build_tokenizer
        try:
            vocab = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                    vocab_file=args.vocab_file, merge_file=args.merge_file,
                                    vocab_size=args.vocab_size).vocab_size
        except MegaliteError as e:
            raise type(e)(f"{e} (or pass --tokenizer-vocab-size)") from None
    if tool_args.world_size <= 0:
        raise MegaliteError(f"--world-size must be positive, got {tool_args.world_size}")
    return validate_model_args(args, tool_args.world_size, vocab)


def describe(config: Config) -> list[str]:
    m, p, t, pr = config.model, config.parallel, config.training, config.precision
    v = p.virtual_pipeline_model_parallel_size
    if p.pipeline_model_parallel_size == 1:
        schedule = "gradient accumulation (no pipeline)"
    else:
        schedule = f"interleaved 1F1B, {v} chunks per rank" if v else "1F1B"
    recompute = getattr(m, "recompute_granularity", None) or "none"
    if recompute == "full":
        recompute += (f" ({getattr(m, 'recompute_method', None)}, "
                      f"{getattr(m, 'recompute_num_layers', 1)} layers)")
    world = (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
             * p.context_parallel_size * p.data_parallel_size)
    cp = (f" x CP {p.context_parallel_size} ({m.cp_comm_type})"
          if p.context_parallel_size > 1 else "")
    return [
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        f"({m.num_query_groups} query groups), MLP {m.ffn_hidden_size}"
        f"{' SwiGLU' if m.swiglu else ''}, {m.normalization}, "
        f"{m.position_embedding_type} positions, vocabulary {m.padded_vocab_size} (padded), "
        f"{'untied' if m.untie_embeddings_and_output_weights else 'tied'} output layer, "
        f"attention {m.attention_backend}"
        + (f"; MoE: {m.num_experts} experts of width {m.moe_ffn_hidden_size}, top "
           f"{m.moe_router_topk}, in {sum(m.moe_layer_pattern)} of {m.num_layers} layers"
           if m.num_experts else ""),
        f"layout: world {world} = TP {p.tensor_model_parallel_size} x "
        f"PP {p.pipeline_model_parallel_size} x DP {p.data_parallel_size}"
        f"{cp}; "
        f"sequence parallel {'on' if m.sequence_parallel else 'off'}; "
        f"{_sharding(config)}; schedule {schedule}",
        f"batch: micro-batch {t.micro_batch_size} x seq {m.seq_length}, "
        f"{t.num_microbatches} micro-batches per step per DP rank, global batch "
        f"{t.global_batch_size}; {DTYPE_NAMES[pr.params_dtype]} parameters, "
        f"{DTYPE_NAMES[config.grad_dtype]} gradient buffer; "
        f"recompute {recompute}",
    ]


def _sharding(config: Config) -> str:
    p = config.parallel
    if p.use_torch_fsdp2:
        zero = "ZeRO-3" if p.data_parallel_sharding_strategy == "optim_grads_params" else "ZeRO-2"
        text = f"FSDP2 {zero} ({p.data_parallel_sharding_strategy}), gradients reduce-" + \
            ("scattered every micro-batch" if p.fsdp_grad_reduce_every_micro_batch
             else "scattered after the last micro-batch")
    else:
        text = f"ZeRO-1 {'on' if p.use_distributed_optimizer else 'off'}"
    return text + ("; optimizer state offloaded to the host" if p.optimizer_cpu_offload else "")


def format_table(config: Config, ranks: list[RankMemory], gpu_gib: float,
                 device: str = "cuda") -> str:
    total_params = num_model_parameters(config)
    layers = "compiled" if config.layers_compiled(device) else "eager"
    lines = [f"megalite memory plan ({device} kernels, {layers} layers): "
             f"{total_params / 1e9:.3f}B parameters"]
    lines += ["  " + line for line in describe(config)]
    lines += ["", "| PP rank | params (B) | params | grads | optimizer | fp32 main grads "
                  "| activations (in flight) | total GiB | of GPU |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in ranks:
        lines.append(
            f"| {r.pp_rank} | {r.num_parameters / 1e9:.3f} | {_gib(r.parameters)} "
            f"| {_gib(r.gradients)} | {_gib(r.optimizer_state)} | {_gib(r.main_grads)} "
            f"| {_gib(r.activations)} ({r.microbatches_in_flight:g}) | {_gib(r.total)} "
            f"| {100 * r.total / GiB / gpu_gib:.0f}% |")
    worst = max(ranks, key=lambda r: r.total)
    left = gpu_gib - worst.total / GiB
    verdict = (f"fits, {left:.1f} GiB left" if left > 0
               else f"does NOT fit: {-left:.1f} GiB over")
    lines += ["", f"most loaded: PP rank {worst.pp_rank}, total {_gib(worst.total)} GiB of "
                  f"{gpu_gib:g} GiB ({100 * worst.total / GiB / gpu_gib:.0f}%): {verdict} "
                  "for transients, the CUDA context, NCCL buffers and fragmentation",
              f"activations of one micro-batch on that rank: "
              f"{_gib(worst.activations_per_microbatch)} GiB; p2p send buffers held at the "
              f"peak: {_gib(worst.p2p_buffers)} GiB"]
    if worst.host:
        lines.append(f"host memory per GPU (--optimizer-cpu-offload): {_gib(worst.host)} GiB")
    snapshot = max(r.async_save_host for r in ranks)
    if snapshot:
        lines.append(f"host buffers of --async-save per GPU (DP rank 0, kept between saves; "
                     f"pinned on CUDA): {_gib(snapshot)} GiB")
    lines += moe_lines(config)
    if worst.grad_compression:
        lines.append("in the total, PowerSGD's error buffers, Qs and a bucket's P and Q "
                     f"(--grad-compression): {_gib(worst.grad_compression)} GiB")
    return "\n".join(lines)


def moe_lines(config: Config) -> list[str]:
    """The MoE part of the plan: expert weights by optimizer group, worst-case dispatch."""
    m = config.model
    if m.num_experts is None:
        return []
    counts = expert_weights(config, rank_parameters(config, 0))
    tokens = config.training.micro_batch_size * m.seq_length // config.parallel.context_parallel_size
    return [f"experts (PP rank 0, one rank's shard): {counts['experts'] / 1e6:.3f}M routed expert "
            f"parameters (reduced and sharded over expert-DP), {counts['dense'] / 1e6:.3f}M "
            f"others (over DP x CP); worst case {dispatched_rows(config, tokens)} dispatched "
            f"rows per MoE layer and micro-batch ({tokens} tokens x top "
            f"{m.moe_router_topk}{', capacity-bounded' if m.moe_expert_capacity_factor else ''}"
            ") in the activations"]


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f}"


def main(argv=None) -> int:
    tool_args, train_argv = build_parser().parse_known_args(argv)
    try:
        config = load_config(tool_args, train_argv)
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ranks = estimate_memory(config, tool_args.device)
    print(format_table(config, ranks, tool_args.gpu_memory_gib, tool_args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
