r"""Sample text from a checkpoint with a KV cache (megalite/inference.py).

    # The model and tokenizer flags of the training run, the checkpoint, a prompt:
    python tools/generate.py <model flags> --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model tok.model --load ckpt/run1 --prompt "def main(" \
        [--max-new-tokens 64] [--greedy | --temperature 0.8 --top-k 40 --top-p 0.95] [--seed 1]
    # Tensor-parallel, T processes:
    torchrun --nproc-per-node 2 tools/generate.py --tensor-model-parallel-size 2 ...

The checkpoint may have been saved at any (TP, PP, DP) layout: it loads into this run's
TP size; a --multi-latent-attention model caches each token's latent and RoPE key part, not
its keys and values (megalite/inference.py). Only the model, tokenizer and parallel flags are
needed; training flags (batch
sizes, learning rate, data) are accepted so a training command line can be reused, and
are not used. An empty --prompt starts a new document
(from the end-of-document token). Rank 0 prints the generated token ids, then the text:
the prompt followed by its completion.
"""

import dataclasses
import sys
import time

import torch
import torch.distributed as dist

from megalite.arguments import build_parser
from megalite.config import Config
from megalite.data.tokenizer import build_tokenizer
from megalite.errors import ConfigError, MegaliteError
from megalite.inference import Sampling, check_length, generate, load_model_weights, max_positions
from megalite.initialize import initialize_distributed, world_size_from_env
from megalite.parallel_state import ParallelState
from megalite.run_file import parse_with_run_file
from megalite.training import build_model
from megalite.validation import validate_model_args


def parse_args(argv=None):
    parser = build_parser()
    parser.prog = "generate.py"
    parser.description = "Sample text from a megalite checkpoint (Megatron-LM model flags)."
    g = parser.add_argument_group("generation")
    g.add_argument("--prompt", default="", help="Text to continue (empty: a new document).")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="Tokens to generate at most (default: as many as the model's positions "
                        "hold after the prompt); generation also stops at end of document.")
    g.add_argument("--greedy", action="store_true", help="Always take the most likely token.")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="Sample from the k most likely (0: all).")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="Sample from the smallest set of tokens with this much probability "
                        "(1: all).")
    return parse_with_run_file(parser, argv)


def build_config(args) -> tuple[Config, object]:
    if args.load is None:
        raise ConfigError("--load is required: the checkpoint directory to generate from")
    if args.tokenizer_type is None:
        raise ConfigError("--tokenizer-type is required (and its files); NullTokenizer "
                          "takes whitespace-separated token ids as the prompt")
    tokenizer = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                vocab_file=args.vocab_file, merge_file=args.merge_file,
                                vocab_size=args.vocab_size)
    if args.pipeline_model_parallel_size != 1:
        raise ConfigError(f"generation runs the whole model on every rank: pass "
                          f"--pipeline-model-parallel-size 1, not "
                          f"{args.pipeline_model_parallel_size} (a checkpoint saved at any "
                          f"pipeline size loads)")
    if args.context_parallel_size != 1:
        raise ConfigError(f"generation decodes one token at a time, which cannot be split "
                          f"over context-parallel ranks: pass --context-parallel-size 1, not "
                          f"{args.context_parallel_size} (a checkpoint saved at any "
                          f"context-parallel size loads)")
    config = validate_model_args(args, world_size_from_env(), tokenizer.vocab_size)
    p = config.parallel
    if p.data_parallel_size != 1:
        raise ConfigError(f"launch as many processes as --tensor-model-parallel-size="
                          f"{p.tensor_model_parallel_size}, not {world_size_from_env()}")
    # One token at a time cannot be split along the sequence; no dropout at inference.
    model = dataclasses.replace(config.model, sequence_parallel=False, attention_dropout=0.0,
                                hidden_dropout=0.0)
    parallel = dataclasses.replace(p, virtual_pipeline_model_parallel_size=None)
    return dataclasses.replace(config, model=model, parallel=parallel), tokenizer


def prompt_tokens(args, tokenizer, config: Config) -> list[int]:
    tokens = tokenizer.tokenize(args.prompt)
    if not tokens:
        if tokenizer.eod is None:
            raise ConfigError("--prompt is empty and this tokenizer has no end-of-document "
                              "token to start a new document from")
        tokens = [tokenizer.eod]
    if args.max_new_tokens is None:
        args.max_new_tokens = max(max_positions(config.model) - len(tokens), 0)
    check_length(len(tokens), args.max_new_tokens, config.model)
    bad = [t for t in tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise ConfigError(f"--prompt holds ids outside the vocabulary [0, "
                          f"{tokenizer.vocab_size}): {bad[:10]}")
    return tokens


def run(args, config: Config, tokenizer, tokens: list[int], rank: int, device: torch.device):
    state = ParallelState(config.parallel.grid, rank)
    model = build_model(config, state, device, rng_tracker=None)[0].eval()
    iteration, directory, meta = load_model_weights(config.checkpoint.load, model)
    layout = meta["layout"]
    sampling = Sampling(args.greedy, args.temperature, args.top_k, args.top_p)
    start = time.perf_counter()
    new = generate(model, torch.tensor([tokens]), args.max_new_tokens, sampling,
                   eod=tokenizer.eod, seed=args.seed)[0].tolist()
    elapsed = time.perf_counter() - start
    if rank != 0:
        return
    ended = tokenizer.eod is not None and tokenizer.eod in new
    print(f" > loaded iteration {iteration} from {directory} (saved at TP "
          f"{layout['tensor_model_parallel_size']} PP {layout['pipeline_model_parallel_size']} "
          f"DP {layout['data_parallel_size']}), generating at TP {state.tp_size}", flush=True)
    print(f" > prompt: {len(tokens)} tokens; generated {len(new)} tokens in {elapsed:.2f} s "
          f"({'end of document' if ended else '--max-new-tokens'})", flush=True)
    print(f" > generated token ids: {' '.join(map(str, new))}", flush=True)
    text_ids = tokens + (new[:new.index(tokenizer.eod)] if ended else new)
    if not args.prompt:
        text_ids = text_ids[1:]  # the end-of-document token that started a new document
    print(tokenizer.detokenize(text_ids), flush=True)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        config, tokenizer = build_config(args)
        tokens = prompt_tokens(args, tokenizer, config)
        Sampling(args.greedy, args.temperature, args.top_k, args.top_p)  # refuse bad flags now
        rank, _, device = initialize_distributed(config.distributed)
    except MegaliteError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        run(args, config, tokenizer, tokens, rank, device)
        return 0
    except MegaliteError as e:
        print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
