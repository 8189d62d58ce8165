"""Multi-latent attention's KV cache against grouped-query attention's at the same model width
(issue 43).

    python benchmarks/mla_kv_cache.py

For two widths, DeepSeek-V3's (hidden 7168, 128 heads, 61 layers) and Llama 3 8B's (4096, 32
heads, 32 layers), builds each model twice on the meta device (shapes, no memory): with MLA
at DeepSeek-V3's latent sizes (kv_lora_rank 512, qk_pos_emb_head_dim 64) and with GQA
(8 groups of head dim 128, Llama 3's). Generation's cache (megalite/inference.KVCache, the
one tools/generate.py fills) is allocated for --max-length positions, and its bytes per token
are measured from its tensors, printed next to the closed form:

    MLA: (kv_lora_rank + qk_pos_emb_head_dim) x layers x bytes
    GQA: 2 x groups x head_dim x layers x bytes

A measured figure off its closed form exits non-zero.
"""

import argparse
import sys
from pathlib import Path

if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.common.smoke import shrink
from megalite.config import GPTConfig
from megalite.inference import KVCache
from megalite.model.gpt import GPTModel

WIDTHS = {  # name: (hidden, heads, layers, ffn, q_lora_rank)
    "DeepSeek-V3": (7168, 128, 61, 18432, 1536),
    "Llama 3 8B": (4096, 32, 32, 14336, None),
}
LATENT = dict(kv_lora_rank=512, qk_pos_emb_head_dim=64, qk_head_dim=128, v_head_dim=128)
GQA = dict(num_query_groups=8, kv_channels=128)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-length", type=int, default=4096, help="Positions the cache holds.")
    p.add_argument("--num-layers", type=int, default=None,
                   help="Layers of every model (default: each width's own).")
    return shrink(p.parse_args(), max_length=8, num_layers=2)


def config(width: str, mla: bool, num_layers: int | None, max_length: int) -> GPTConfig:
    hidden, heads, layers, ffn, q_lora = WIDTHS[width]
    attention = (dict(LATENT, multi_latent_attention=True, qk_layernorm=True, q_lora_rank=q_lora,
                      num_query_groups=heads, kv_channels=LATENT["qk_head_dim"] + 64)
                 if mla else GQA)
    return GPTConfig(num_layers=num_layers or layers, hidden_size=hidden, ffn_hidden_size=ffn,
                     num_attention_heads=heads, seq_length=max_length,
                     max_position_embeddings=max_length, padded_vocab_size=128,
                     position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                     add_bias_linear=False, **attention)


def measured_bytes_per_token(c: GPTConfig, max_length: int) -> int:
    """The bytes generation's cache allocates, over the positions it holds (bf16)."""
    with torch.device("meta"):
        model = GPTModel(c, seed=0).to(torch.bfloat16)
    cache = KVCache(model, batch=1, max_length=max_length)
    total = sum(t.numel() * t.element_size() for t in cache.tensors())
    return total // max_length


def closed_form(c: GPTConfig, bytes_per_value: int = 2) -> int:
    if c.multi_latent_attention:
        return (c.kv_lora_rank + c.qk_pos_emb_head_dim) * c.num_layers * bytes_per_value
    return 2 * c.num_query_groups * c.kv_channels * c.num_layers * bytes_per_value


def main() -> int:
    args = parse_args()
    print(f"KV cache per token, bf16, {args.max_length} positions allocated")
    print(f"{'width':<12} {'layers':>6} {'attention':<34} {'measured B':>11} "
          f"{'closed form B':>13} {'GQA / MLA':>9}")
    failed = False
    for width in WIDTHS:
        rows = {}
        for mla in (True, False):
            c = config(width, mla, args.num_layers, args.max_length)
            rows[mla] = (c, measured_bytes_per_token(c, args.max_length), closed_form(c))
            failed |= rows[mla][1] != rows[mla][2]
        for mla, (c, measured, formula) in rows.items():
            kind = (f"MLA latent {c.kv_lora_rank} + k_pe {c.qk_pos_emb_head_dim}" if mla
                    else f"GQA {c.num_query_groups} groups x 2 x {c.kv_channels}")
            ratio = f"{rows[False][1] / measured:.2f}" if mla else ""
            print(f"{width:<12} {c.num_layers:>6} {kind:<34} {measured:>11,} {formula:>13,} "
                  f"{ratio:>9}")
    if failed:
        print("error: a measured figure differs from its closed form", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
