"""The largest GPT-3-shaped model megalite's memory planner fits on 8 x 80 GB GPUs with
each way of holding the data-parallel copy: plain DP, ZeRO-1, ZeRO-2, ZeRO-3 (FSDP2) and
ZeRO-3 with the optimizer offloaded to the host. The ZeRO lessons' claim, checked with the
planner (megalite/memory_estimate, which benchmarks/zero_memory.py checks against the
tensors of a real step): sharding parameters, gradients and optimizer state over 8 ranks
lets one node train a model several times larger than plain data parallelism.

Layout: TP 1 x PP 1 x DP 8, bf16 (fp32 gradient accumulation, as Megatron forces), micro-
batch 1 x 2048 tokens, full recompute (one layer's input kept per layer). Two global
batches: 8 sequences (one micro-batch per rank: no accumulation) and 512 (64 micro-batches
per rank): FSDP2 then accumulates the gradients unsharded in fp32 until the last micro-
batch reduce-scatters them (4 bytes per parameter per rank), so ZeRO-2/3 keep their
advantage only with few micro-batches, with TP/PP to cut the model first, or with
--fsdp-grad-reduce-every-micro-batch, which reduce-scatters every micro-batch's gradients
into the shards (the "every micro-batch" rows).

    python examples/zero_largest_model.py [--gpu-memory-gib 80] [--host-memory-gib 224]

Offload is bounded by host memory too: by default 224 GiB per GPU (a 2 TiB node of 8 GPUs,
less what the data loaders and the OS need).
"""

import argparse

from megalite.arguments import parse_args
from megalite.memory_estimate import GiB, most_loaded_rank, num_model_parameters
from megalite.validation import validate_model_args

# (layers, hidden, heads): GPT-3's table 2.1 up to 13B, then wider and deeper steps.
LADDER = [(24, 2048, 16), (32, 2560, 32), (32, 4096, 32), (40, 5120, 40), (44, 6144, 48),
          (48, 7168, 56), (64, 8192, 64), (80, 8192, 64), (80, 10240, 80), (96, 12288, 96)]
STRATEGIES = {"plain DP": [], "ZeRO-1": ["--use-distributed-optimizer"],
              "ZeRO-2 (FSDP2)": ["--use-torch-fsdp2", "--data-parallel-sharding-strategy",
                                 "optim_grads"],
              "ZeRO-3 (FSDP2)": ["--use-torch-fsdp2"],
              "ZeRO-2, every micro-batch": ["--use-torch-fsdp2", "--data-parallel-sharding-"
                                            "strategy", "optim_grads",
                                            "--fsdp-grad-reduce-every-micro-batch"],
              "ZeRO-3, every micro-batch": ["--use-torch-fsdp2",
                                            "--fsdp-grad-reduce-every-micro-batch"],
              "ZeRO-3 + offload": ["--use-torch-fsdp2", "--optimizer-cpu-offload"]}


def plan(layers: int, hidden: int, heads: int, strategy: list[str], global_batch: int):
    flags = ["--num-layers", str(layers), "--hidden-size", str(hidden),
             "--num-attention-heads", str(heads), "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--vocab-size", "50257",
             "--micro-batch-size", "1", "--global-batch-size", str(global_batch), "--bf16",
             "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1", "--attention-backend", "flash", *strategy]
    config = validate_model_args(parse_args(flags), 8)
    return num_model_parameters(config), most_loaded_rank(config)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    parser.add_argument("--host-memory-gib", type=float, default=224.0,
                        help="Host memory per GPU for --optimizer-cpu-offload.")
    args = parser.parse_args()
    gpu, host = args.gpu_memory_gib, args.host_memory_gib
    print(f"largest model that fits {gpu:g} GiB per GPU and {host:g} GiB of host memory per "
          f"GPU, 8 GPUs = DP 8 (planner, cuda)")
    print("| strategy | global batch | largest model | GPU GiB | host GiB per GPU | next size |")
    print("|---|---:|---|---:|---:|---|")
    for name, strategy in STRATEGIES.items():
        for global_batch in (8, 512):
            best, over = None, None
            for shape in LADDER:
                params, rank = plan(*shape, strategy, global_batch)
                if rank.total / GiB <= gpu and rank.host / GiB <= host:
                    best = (shape, params, rank)
                else:
                    over = (shape, params, rank)
                    break
            cells = [name, str(global_batch)]
            if best is None:
                cells += ["none", "-", "-"]
            else:
                (layers, hidden, _), params, rank = best
                cells += [f"{params / 1e9:.1f}B ({layers} x {hidden})",
                          f"{rank.total / GiB:.1f}", f"{rank.host / GiB:.1f}"]
            cells.append("-" if over is None else
                         f"{over[1] / 1e9:.1f}B needs {over[2].total / GiB:.0f} GiB"
                         + (f" + {over[2].host / GiB:.0f} GiB host" if over[2].host else ""))
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
