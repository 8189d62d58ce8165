"""PowerSGD's bytes per step (distributed/powersgd.py `plan_bucket`, `compressed_bytes`) for
a GPT with hidden 512 at rank 4, against the closed form written out from the model's
shapes: >= 10x fewer bytes than the uncompressed all-reduce. (The counted bytes at the real
collectives are checked against the same closed form in tests/distributed/test_powersgd.py.)
"""

import torch

import dataclasses

from megalite.arguments import parse_args
from megalite.config import GradCompressionConfig
from megalite.memory_estimate import estimate_memory
from megalite.validation import validate_model_args
from megalite.distributed.powersgd import compressed_bytes, plan_bucket, single_process_names
from megalite.model.gpt import GPTModel
from tests.helpers import tiny_gpt_config

H, FFN, VOCAB, SEQ, LAYERS, RANK = 512, 2048, 50304, 1024, 4, 4


def test_rank_4_at_hidden_512_sends_10x_fewer_bytes_exactly_as_the_closed_form():
    config = tiny_gpt_config(hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=8,
                             kv_channels=64, padded_vocab_size=VOCAB, seq_length=SEQ,
                             num_layers=LAYERS)
    with torch.device("meta"):
        model = torch.nn.ModuleList([GPTModel(config, seed=0)])
    params = list(model.parameters())
    matrices, plain = plan_bucket(params, single_process_names(model),
                                  GradCompressionConfig(kind="powersgd", rank=RANK), 1)
    sent = compressed_bytes(matrices, plain, grad_bytes=4)
    # The closed form: word and position embeddings (tied output layer), per layer QKV,
    # attention projection, fc1, fc2 as (n + m) x rank fp32 factors; every vector whole.
    shapes = [(VOCAB, H), (SEQ, H)] + LAYERS * [(3 * H, H), (H, H), (FFN, H), (H, FFN)]
    vectors = 2 * H + LAYERS * (2 * H + 3 * H + H + 2 * H + FFN + H)
    closed_form = 4 * RANK * sum(n + m for n, m in shapes) + 4 * vectors
    uncompressed = 4 * (sum(n * m for n, m in shapes) + vectors)
    assert uncompressed == 4 * sum(p.numel() for p in params)
    assert sent == closed_form
    assert uncompressed / sent >= 10, uncompressed / sent


def test_planner_counts_error_buffers_qs_and_one_buckets_factors():
    flags = ["--num-layers", str(LAYERS), "--hidden-size", str(H), "--ffn-hidden-size",
             str(FFN), "--num-attention-heads", "8", "--seq-length", str(SEQ),
             "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "128",
             "--micro-batch-size", "1", "--grad-compression", "powersgd",
             "--powersgd-rank", str(RANK), "--ddp-bucket-size", str(10**9)]
    config = validate_model_args(parse_args(flags), 2)
    plain = dataclasses.replace(config, grad_compression=GradCompressionConfig())
    extra = estimate_memory(config, "cpu")[0].total - estimate_memory(plain, "cpu")[0].total
    shapes = [(VOCAB, H), (SEQ, H)] + LAYERS * [(3 * H, H), (H, H), (FFN, H), (H, FFN)]
    # fp32 error (n x m) and last Q (m x rank) per matrix; P and Q of the larger bucket:
    # the (tied) word embeddings have a bucket of their own, the rest share one.
    factors = [(n + m) * RANK for n, m in shapes]
    closed_form = 4 * sum(n * m + m * RANK for n, m in shapes) + 4 * max(factors[0],
                                                                        sum(factors[1:]))
    assert extra == closed_form
