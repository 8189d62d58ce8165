"""Megatron-LM's command-line flags: one parser, grouped as in `--help`.

Flag names and defaults follow Megatron-LM so scripts port unchanged. `parse_args` only
parses; `megalite.validation.validate_args` turns the namespace into frozen dataclasses and
rejects combinations that cannot work. Nothing here is read as a global.
"""

import argparse

from megalite.data.tokenizer import TOKENIZER_TYPES
from megalite.run_file import parse_with_run_file


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT model with megalite (Megatron-LM flags).",
        allow_abbrev=False,
    )
    for add_group in (_model, _parallelism, _training, _learning_rate, _mixed_precision,
                      _data, _checkpointing, _logging, _distributed, _monitoring, _fsdp,
                      _add_fp8_args, _add_uneven_work_args, _add_async_save_args,
                      _add_wandb_args, _add_grad_compression_args, _add_moe_args,
                      _add_kernel_switches):
        add_group(parser)
    parser.add_argument("--yaml-cfg", metavar="FILE",
                        help="A run file: YAML whose keys are these flags' names (grouped or "
                             "flat); flags on the command line override it. Megatron's flag "
                             "name; megalite's meaning (Megatron's file has its own schema).")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return parse_with_run_file(build_parser(), argv)


def _model(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, help="Transformer hidden size.")
    g.add_argument("--ffn-hidden-size", type=int, help="MLP hidden size (default 4 x hidden size).")
    g.add_argument("--num-attention-heads", type=int, help="Number of attention heads.")
    g.add_argument("--group-query-attention", action="store_true",
                   help="Use grouped-query attention (--num-query-groups K/V heads).")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="Number of K/V head groups under --group-query-attention.")
    g.add_argument("--kv-channels", type=int,
                   help="Per-head dimension (default hidden size / heads).")
    g.add_argument("--seq-length", type=int, help="Sequence length to train on.")
    g.add_argument("--max-position-embeddings", type=int,
                   help="Size of the learned position table (default --seq-length).")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope"], help="Position embedding.")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base.")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="Fraction of each head's channels rotated by RoPE.")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU.")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="No biases in linear layers.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate input embedding and output layer weights.")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="Std of the normal init; output projections get std/sqrt(2L).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this (times TP size).")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "flash", "sdpa", "unfused"],
                   help="Attention kernel: flash-attn, torch SDPA, or the explicit reference; "
                        "auto picks the fastest available. Under --cp-comm-type p2p the "
                        "ring's blocks run on torch's fused flash kernels for sdpa and flash "
                        "(CPU; CUDA fp16/bf16), on megalite's fp32 block kernel for unfused, "
                        "with attention dropout, and where torch has no fused kernel (sdpa; "
                        "flash then stops with an error).")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="Alias of --attention-backend flash (flash-attn: head size <= 256 "
                        "and a multiple of 8).")
    g.add_argument("--recompute-granularity", choices=["full", "selective"],
                   help="Activation recompute: whole transformer layers (full) or only the "
                        "core attention (selective).")
    g.add_argument("--recompute-method", choices=["uniform", "block"],
                   help="full: checkpoint groups of --recompute-num-layers layers (uniform), "
                        "or the first --recompute-num-layers layers of each stage (block).")
    g.add_argument("--recompute-num-layers", type=int)
    g.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each transformer layer (megalite's own flag; Megatron "
                        "has none, and fuses through Transformer Engine instead). Default: on "
                        "when training on a GPU at TP 1 and CP 1 without --num-experts, "
                        "--use-torch-fsdp2, --pipeline-schedule zb-h1 or --recompute-"
                        "granularity selective, off otherwise; "
                        "--no-compile-layers runs eagerly. Same results within bf16 "
                        "round-off; the first step compiles, which takes a while.")


def _parallelism(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1: shard optimizer state across data-parallel ranks.")
    g.add_argument("--ddp-bucket-size", type=int,
                   help="Elements per data-parallel gradient all-reduce (default 40M).")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Reduce each gradient bucket as soon as backward completes it.")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="ZeRO-1: all-gather updated parameters during the next forward.")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Accumulate and reduce fp16 gradients in an fp32 buffer (always on "
                        "with --bf16, as in Megatron).")
    g.add_argument(
        "--pipeline-schedule", default="1f1b", choices=["1f1b", "gpipe", "zb-h1"],
        help="Pipeline schedule, with p stages, m micro-batches per step and F, B, W the "
             "times of a stage's forward, input-gradient and weight-gradient passes. "
             "1f1b (Megatron's; interleaved with --num-layers-per-virtual-pipeline-stage): "
             "bubble (p-1)/m, (p-1)/(v m) interleaved; the first stage holds the "
             "activations of p micro-batches. gpipe: all forwards, then all backwards; "
             "bubble (p-1)/m, activations of all m micro-batches. zb-h1 (zero bubble, Qi "
             "et al. 2024): 1F1B with each backward split into B and W, the Ws deferred "
             "into 1F1B's idle time; bubble (p-1)(F+B-W)/(m(F+B+W)), a third of 1F1B's "
             "when F = B = W; at most p micro-batches in flight on every stage (the first "
             "as in 1F1B), each deferred W keeping its linear layers' inputs and output "
             "gradients. gpipe and zb-h1 go beyond Megatron-LM (megalite's own choices) "
             "and run one model chunk per stage (no interleaving).")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="CP: split each sequence over this many ranks (2 x CP load-balanced "
                        "chunks; --seq-length must divide by 2 x CP).")
    g.add_argument("--cp-comm-type", default="p2p", choices=["p2p", "all_gather"],
                   help="How attention sees the other CP ranks' keys and values: p2p (ring "
                        "attention, overlapped with compute; its blocks on the "
                        "--attention-backend's kernel, see there) or all_gather (all K/V "
                        "gathered; cheap with GQA). Megatron's a2a is not implemented.")


def _add_fp8_args(parser):
    g = parser.add_argument_group("fp8")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"],
                   help="Run the transformer layers' linear GEMMs (QKV, projection, MLP) in "
                        "FP8 with torch._scaled_mm: e4m3 for inputs and weights, gradients "
                        "e4m3 too (e4m3) or e5m2 (hybrid). Master weights, optimizer state, "
                        "checkpoints, norms, attention, the embedding and the output layer "
                        "stay in the model's dtype. Needs compute capability >= 8.9 on a GPU; "
                        "runs on CPUs.")
    g.add_argument("--fp8-recipe", default="tensorwise",
                   choices=["tensorwise", "rowwise", "delayed", "mxfp8", "blockwise"],
                   help="FP8 scaling: tensorwise (Megatron's name; one scale per tensor from "
                        "its current amax, reduced over the TP group where it is sharded; "
                        "megalite's default, Megatron's is delayed) or rowwise (megalite's own "
                        "name for torchao's rowwise scaling: one scale per row along each "
                        "GEMM's contraction dim; e4m3 only). delayed, mxfp8 and blockwise are "
                        "Megatron's and not built.")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="With --fp8-format: keep the first --num-layers-at-start-in-bf16 and "
                        "the last --num-layers-at-end-in-bf16 transformer layers out of FP8.")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1)
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1)


def _fsdp(parser):
    g = parser.add_argument_group("fully sharded data parallelism")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="Shard parameters, gradients and optimizer state over data-parallel "
                        "ranks with torch's FSDP2 (fully_shard per transformer layer). Unlike "
                        "Megatron, megalite composes it with TP, PP (also interleaved, tied "
                        "embeddings), fp16, and loads any checkpoint layout.")
    g.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                   choices=["optim_grads", "optim_grads_params"],
                   help="With --use-torch-fsdp2: optim_grads = ZeRO-2 (parameters kept "
                        "gathered from forward to backward), optim_grads_params = ZeRO-3.")
    g.add_argument("--fsdp-grad-reduce-every-micro-batch", action="store_true",
                   help="With --use-torch-fsdp2 and several micro-batches per step: reduce-"
                        "scatter the gradients after every micro-batch's backward into the "
                        "sharded gradients (as Megatron-FSDP does), so no rank holds its "
                        "model's whole gradients; m reduce-scatters per step for m micro-"
                        "batches. Default: gradients accumulated unsharded, reduced once after "
                        "the last micro-batch (megalite's option, beyond Megatron).")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="fp32 main parameters and Adam moments in host memory, the optimizer "
                        "step on the host: with --use-torch-fsdp2 or "
                        "--use-distributed-optimizer (this rank's shard).")


def _training(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int,
                   help="Samples per optimizer step (default micro batch x DP); the schedule "
                        "(--lr-*-iters) is counted in samples of this batch.")
    g.add_argument("--train-iters", type=int)
    g.add_argument("--train-samples", type=int)
    g.add_argument("--exit-interval", type=int,
                   help="Exit after the iteration that is a multiple of this.")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global grad-norm clip (0: off).")


def _learning_rate(parser):
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "WSD"])
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float,
                   help="Warm-up as a fraction of the decay steps.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-decay-iters", type=int, help="Default --train-iters.")
    g.add_argument("--lr-decay-samples", type=int, help="Default --train-samples.")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-wsd-decay-iters", type=int)
    g.add_argument("--lr-wsd-decay-samples", type=int)


def _mixed_precision(parser):
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters, fp32 main parameters; gradients accumulated and "
                        "reduced in fp32 (--accumulate-allreduce-grads-in-fp32 implied).")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, help="Static fp16 loss scale (default: dynamic).")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _data(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="Synthetic counting documents (Megatron's mock GPT dataset).")
    g.add_argument("--vocab-size", type=int,
                   help="Vocabulary size for --mock-data / NullTokenizer.")
    g.add_argument("--data-path", nargs="*",
                   help="Indexed dataset prefixes, optionally weighted: [w1] p1 [w2 p2 ...].")
    g.add_argument("--split", default="969,30,1",
                   help="Train/valid/test proportions of each dataset's documents.")
    g.add_argument("--data-cache-path",
                   help="Where sample indices are cached (default: beside the data).")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model",
                   help="SentencePiece model, or tokenizer.json for HuggingFaceTokenizer.")
    g.add_argument("--vocab-file", help="GPT2BPETokenizer vocab.json.")
    g.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt.")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="No loss on positions whose input token is end-of-document.")
    g.add_argument("--num-workers", type=int, default=2, help="Data loader worker processes.")


def _checkpointing(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", help="Directory to write checkpoints to.")
    g.add_argument("--load",
                   help="Directory to resume from (its newest complete checkpoint); "
                        "point it at --save so a restarted job resumes by itself.")
    g.add_argument("--save-interval", type=int,
                   help="Save every this many iterations (and always at exit).")
    g.add_argument("--keep-last-n-checkpoints", type=int, default=0,
                   help="Delete all but the newest N checkpoints (0: keep all); the one "
                        "the tracker names is never deleted.")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="Load the model only and start at iteration 0.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM or SIGUSR1 (any rank) save at the next iteration and "
                        "exit 0.")
    g.add_argument("--exit-duration-in-mins", type=float,
                   help="Save and exit once training has run this long.")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="Do not stop when the loss or a gradient is NaN or infinite.")


def _add_async_save_args(parser):
    g = parser.add_argument_group("asynchronous and non-persistent checkpoints")
    g.add_argument("--async-save", action="store_true",
                   help="Training waits only while each rank copies its state to host "
                        "memory; a background thread writes the same files a synchronous "
                        "save writes, and the tracker names the checkpoint once every rank "
                        "has written its files (checked each iteration). A save while one "
                        "is pending first waits for it; exits wait for it too.")
    g.add_argument("--non-persistent-save-interval", type=int,
                   help="Also save every this many iterations to a fast, non-persistent "
                        "place (--non-persistent-ckpt-type), kept only until the next "
                        "--save checkpoint; a restart prefers it when it is newer and "
                        "every rank has it.")
    g.add_argument("--non-persistent-ckpt-type", choices=["local"],
                   help="local: each rank writes its own state into "
                        "--non-persistent-local-ckpt-dir, a directory on its node's disk "
                        "(Megatron's 'global' and 'in_memory' are not supported).")
    g.add_argument("--non-persistent-local-ckpt-dir",
                   help="The node-local directory of --non-persistent-ckpt-type local.")


def _logging(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true",
                   help="Add TFLOP/s/GPU and tokens/s to the log line.")
    g.add_argument("--tensorboard-dir")
    g.add_argument("--scaling-baseline-tokens-per-sec", type=float,
                   metavar="TOKENS_PER_SEC",
                   help="Tokens/s of one GPU on this model (megalite's own flag; e.g. from "
                        "tools/check_cluster.py): adds the scaling efficiency, tokens/s per "
                        "GPU over it, to the log line.")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)


def _add_wandb_args(parser):
    """Megatron's Weights & Biases flags (issue 31): the TensorBoard scalars and the run's
    config, written by the last rank (megalite/monitoring/wandb_logger.py)."""
    g = parser.add_argument_group("weights & biases")
    g.add_argument("--wandb-project", help="W&B project; a run is logged when given "
                   "(WANDB_MODE=offline writes it locally). Needs pip install -e .[wandb].")
    g.add_argument("--wandb-exp-name", help="The W&B run's name (required with a project).")
    g.add_argument("--wandb-save-dir", help="Where W&B writes its files (default "
                   "{--save}/wandb, as Megatron; without --save, wandb's default).")


def _monitoring(parser):
    """Megatron's logging and profiling flags for seeing what a run does (issue 17)."""
    g = parser.add_argument_group("monitoring")
    g.add_argument("--peak-tflops", type=float,
                   help="Dense peak TFLOP/s of one device, for the MFU on the log line "
                        "(megalite's own flag; default: a table of common GPUs, see "
                        "megalite/monitoring/peak_flops.py; no MFU on a CPU without it).")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="Memory (max over ranks) as TensorBoard scalars.")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="0: iteration time only; 1: also the phases run once a step "
                        "(gradient reduction, optimizer, ...); 2: also per micro-batch "
                        "(forward/backward compute, pipeline send/recv). Levels 1-2 "
                        "synchronise the GPU at each phase boundary.")
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
                   help="Timers over ranks: max, (min, max), or every rank's.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-straggler", action="store_true",
                   help="Name the slowest and fastest rank (and host) by compute time "
                        "each log interval.")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int,
                   help="Every N iterations compare the data-parallel replicas' parameter "
                        "hashes; stop with an error naming the ranks if they differ.")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--profile", action="store_true",
                   help="Write a torch.profiler Chrome trace (--profile-dir) of the steps "
                        "--profile-step-start+1 .. --profile-step-end on --profile-ranks.")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument("--profile-dir",
                   help="Where traces go (megalite's own flag; default --tensorboard-dir, "
                        "else ./profile).")
    g.add_argument("--record-memory-history", action="store_true",
                   help="GPU: record the CUDA allocator's history and write a snapshot to "
                        "--memory-snapshot-path (at the profile's end, else after the "
                        "first log interval, and when a step runs out of memory).")
    g.add_argument("--memory-snapshot-path", default="snapshot.pickle")


def _distributed(parser):
    g = parser.add_argument_group("distributed")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"],
                   help="Default: nccl when an accelerator is visible, else gloo.")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="How long a collective (and the start-up rendezvous) waits for "
                        "the other ranks before it fails; a rank whose training made no "
                        "progress for twice this is ended (megalite's watchdog). megalite "
                        "takes fractions (0.25: 15 s), where Megatron-LM takes whole "
                        "minutes.")


def _add_uneven_work_args(parser):
    """Uneven work for mixed or straggling hardware (issue 29, docs/guide.md "Mixed or
    straggling hardware"): fewer layers on the pipeline's end stages, and uneven
    data-parallel shares."""
    g = parser.add_argument_group("uneven pipeline stages and data-parallel shares")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int,
                   help="Layers of the first pipeline rank (split evenly over its virtual "
                        "stages); the other ranks share the rest evenly (Megatron's).")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int,
                   help="Layers of the last pipeline rank, as above (Megatron's).")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="Count the embedding as one layer of the first stage in the even "
                        "split (Megatron's).")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="Count the output layer and loss as one layer of the last stage in "
                        "the even split (Megatron's).")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int,
                   help="Model chunks per pipeline rank v (interleaved 1F1B); the way to "
                        "interleave an uneven split (Megatron's).")
    g.add_argument("--pipeline-model-parallel-layout", type=str,
                   help="Megatron's per-stage layout string: not implemented in megalite "
                        "(refused); use the flags above.")
    g.add_argument("--data-parallel-shares", metavar="W0,W1,...|auto",
                   help="megalite's own: micro-batches of every global batch per DP rank in "
                        "proportion to these weights (one per DP rank, e.g. 3,1), or 'auto': "
                        "from each DP replica's measured speed (the --log-straggler timers), "
                        "re-balanced when a speed moves by more than "
                        "--data-parallel-shares-threshold. The samples of a global batch and "
                        "the update stay one process's at any shares.")
    g.add_argument("--data-parallel-shares-threshold", type=float, default=0.2,
                   help="megalite's own: with --data-parallel-shares auto, re-balance when a "
                        "replica's speed moves by more than this fraction.")
    g.add_argument("--data-parallel-shares-window", type=int, default=3,
                   help="megalite's own: with --data-parallel-shares auto, steps timed per "
                        "measurement of the speeds (after the first step).")


def _add_grad_compression_args(parser):
    g = parser.add_argument_group(
        "gradient compression (megalite's own flags; Megatron-LM has no such feature: names "
        "follow torch's PowerSGDState)")
    g.add_argument("--grad-compression", default="none", choices=["none", "powersgd"],
                   help="Megalite's own. powersgd: low-rank DP x CP gradient reduction "
                        "(Vogels et al. 2019; docs/design.md). Not with --use-torch-fsdp2, --fp16.")
    g.add_argument("--powersgd-rank", type=int, default=1,
                   help="Megalite's own (torch: matrix_approximation_rank). Columns of P and Q.")
    g.add_argument("--powersgd-start-iter", type=int, default=1000,
                   help="Megalite's own (torch: start_powerSGD_iter). Steps reduced "
                        "uncompressed before compression starts.")
    g.add_argument("--powersgd-min-compression-rate", type=float, default=2.0,
                   help="Megalite's own (torch: min_compression_rate). A matrix n x m is "
                        "compressed only if n*m > rate*(n+m)*rank; smaller matrices and "
                        "vectors are reduced as they are.")
    g.add_argument("--no-powersgd-error-feedback", dest="powersgd_error_feedback",
                   action="store_false",
                   help="Megalite's own (torch: use_error_feedback=False). Drop the "
                        "compression error instead of adding it to the next gradient.")
    g.add_argument("--no-powersgd-warm-start", dest="powersgd_warm_start", action="store_false",
                   help="Megalite's own (torch: warm_start=False). Draw a new random Q every "
                        "step instead of reusing the last one.")
    g.add_argument("--powersgd-orthogonalization-epsilon", type=float, default=0.0,
                   help="Megalite's own (torch: orthogonalization_epsilon). Added to column "
                        "norms when orthogonalising; > 0 guards all-zero gradient matrices.")


# Megatron's switches for its own fused kernels (Transformer Engine, Apex, its JIT fusions).
# megalite has none of these kernels to switch off: on a GPU its compiled layers fuse the
# same ops. Accepted, with no effect, so that a Megatron launch script runs as written.
KERNEL_SWITCHES = ("--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                   "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
                   "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
                   "--attention-softmax-in-fp32", "--use-mcore-models")


def _add_kernel_switches(parser):
    g = parser.add_argument_group(
        "Megatron's kernel switches",
        "Megatron's flags for its fused kernels and model code, accepted so that its launch "
        "scripts run unchanged. megalite has one implementation of each layer; on a GPU "
        "--compile-layers (the default there) fuses the norm, RoPE, activation, bias and "
        "dropout chains, and attention runs in fused kernels with an fp32 softmax.")
    for name in KERNEL_SWITCHES:
        g.add_argument(name, action="store_true", help="Megatron's; no effect in megalite.")
    g.add_argument("--transformer-impl", default="transformer_engine",
                   choices=["local", "transformer_engine"],
                   help="Megatron's; megalite runs its own layers under either name (compiled "
                        "on a GPU by default, where Megatron would use Transformer Engine).")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="Compile the loss (torch.compile) even with eager layers, at TP 1; "
                        "with compiled layers it is compiled anyway. Over a TP group the loss "
                        "is the eager vocab-parallel one. (Megatron's flag; its own kernel.)")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native"],
                   help="Megatron's; its Transformer Engine kernel (te) is not available.")


# Megatron's MoE flags that megalite does not build: refused by name (validation/moe.py).
MOE_REFUSED_FLAGS = ("--moe-router-group-topk", "--moe-router-num-groups",
                     "--expert-tensor-parallel-size", "--moe-use-upcycling",
                     "--moe-router-topk-scaling-factor", "--moe-router-dtype",
                     "--moe-input-jitter-eps", "--moe-layer-recompute",
                     "--moe-shared-expert-overlap", "--moe-permute-fusion",
                     "--moe-router-fusion", "--moe-enable-deepep", "--moe-extended-tp",
                     "--moe-use-legacy-grouped-gemm", "--moe-per-layer-logging")


def _add_moe_args(parser):
    """Mixture of experts (issue 32, docs/design.md "Mixture of experts"), Megatron's flags."""
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int,
                   help="Routed experts per MoE layer (unset: a dense model).")
    g.add_argument("--moe-ffn-hidden-size", type=int,
                   help="Hidden size of each routed expert (default --ffn-hidden-size).")
    g.add_argument("--moe-router-topk", type=int, default=2,
                   help="Experts each token is routed to.")
    g.add_argument("--moe-layer-freq", default="1",
                   help="Which layers are MoE: an int N (every Nth layer, from layer 0) or a "
                        "Python list expression of 0/1 per layer, e.g. \"([1]*3+[0]*1)\" "
                        "(Megatron's).")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int,
                   help="Hidden size of the shared experts every token goes through (all "
                        "shared experts as one dense MLP); unset: none.")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "none", "sinkhorn"],
                   help="aux_loss: Switch Transformer's over each micro-batch; seq_aux_loss: "
                        "DeepSeek's per sequence; none. sinkhorn is Megatron's and not built.")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="Weight of the load-balancing loss (added to the gradient, not to "
                        "the reported lm loss).")
    g.add_argument("--moe-z-loss-coeff", type=float,
                   help="Weight of the router z-loss (ST-MoE); unset: none.")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias in "
                        "the choice of experts, updated after each step from the tokens per "
                        "expert of the global batch. Needs --moe-router-score-function "
                        "sigmoid.")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="Step of the expert-bias update.")
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"],
                   help="softmax, or sigmoid normalised over the chosen top k.")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Softmax over all experts before the top k (default: the top k "
                        "logits, then a softmax among them).")
    g.add_argument("--moe-expert-capacity-factor", type=float,
                   help="Capacity of each expert, tokens x topk / experts x this factor; "
                        "pairs beyond it are dropped (unset: dropless).")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"],
                   help="Beyond capacity drop the lowest-probability pairs (probs) or the "
                        "latest tokens (position).")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Pad each expert's input to its capacity (needs "
                        "--moe-expert-capacity-factor).")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="Run the experts as grouped GEMMs (torch._grouped_mm) instead of a "
                        "loop over experts.")
    g.add_argument("--moe-token-dispatcher-type", default="allgather",
                   choices=["allgather", "alltoall", "flex"],
                   help="How tokens reach the experts of other EP ranks: allgather or "
                        "alltoall. flex is Megatron's (DeepEP) and not built.")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP: ranks the routed experts are split over.")
    for name in MOE_REFUSED_FLAGS:
        g.add_argument(name, nargs="?", const=True, default=None, metavar="X",
                       help="Megatron's; not built in megalite (refused).")
