"""What the document flags (--reset-position-ids, --reset-attention-mask,
--dataloader-inter-document-masking; docs/design.md §28) change in the activations one
micro-batch saves, without context parallelism (a CP rank's runs are cut at its chunk
edges too: the bound below is not derived for them). docs/memory.md, "Documents".

- Positions restart per sample, so RoPE's table is gathered per sample, [s, b, 2, rotary
  dim] fp32, once per forward (every layer's rotation saves slices of it), and learned
  positions save [b, s] int64 ids instead of [s].
- `unfused` masks each sample's own [s, s] (documents.py, Documents.visible) in every layer.
- The fused kernels (sdpa's padded batches of documents, the path measured; flash varlen
  and flex pad nothing and are planned the same, as a bound not measured: GPUs only) save the gathered,
  padded Q, K, V, the per-bucket outputs and fp32 log-sum-exp instead of the fused QKV and
  its rotated copies, plus once per forward the int64 gathers' inverses.

How many padded rows a micro-batch's documents take depends on their lengths:
`padded_rows` plans an upper bound, under the assumption its docstring states.
"""

from megalite.documents import SHORTEST_BUCKET


def padded_rows(shape) -> int:
    """Rows of the padded batches of one micro-batch (Documents.padded_batches): each run of
    n rows pads to bucket_length(n), at most 1.5 n for n >= 11 and SHORTEST_BUCKET below.
    Assumed: every document of at least 11 tokens, except the two a sample cuts (its first,
    a document's tail, and its last): 1.5 s + 2 x 16 rows a sample. Shorter documents pad to
    16 rows each and can take more (at worst 16 s, documents of one token)."""
    return shape.micro_batch * ((3 * shape.seq + 1) // 2 + 2 * SHORTEST_BUCKET)


def pads_documents(config, shape) -> bool:
    """A fused kernel runs over the documents' padded batches (documents.py)."""
    return (config.model.masks_documents and config.model.attention_backend != "unfused"
            and shape.cp == 1)


def padded_attention_bytes(config, shape) -> int:
    """Per layer: the padded Q, K, V SDPA keeps, its outputs and fp32 log-sum-exp."""
    rows = padded_rows(shape)
    widths = 2 * shape.query_width + 2 * shape.kv_width  # Q, K, V and the output
    return shape.act_bytes * rows * widths + 4 * shape.heads * rows


def rope_table_bytes(config, shape) -> int:
    """Once per chunk's forward, read by all its layers (and held by a recomputed group's
    inputs): the per-sample RoPE table [s, b, 2, rotary dim] fp32 when positions restart."""
    m = config.model
    if not (m.resets_positions and m.position_embedding_type == "rope"):
        return 0
    return 4 * shape.seq * shape.micro_batch * 2 * int(m.kv_channels * m.rotary_percent)


def gather_index_bytes(config, shape) -> int:
    """Once per chunk's forward where a layer runs the padded path without recompute: the
    int64 inverses its gathers save (queries and keys [b s] each, the outputs' [rows]),
    shared by every layer (Documents caches the plan)."""
    if not pads_documents(config, shape) or config.model.recompute_granularity == "selective":
        return 0
    return 8 * (2 * shape.tokens + padded_rows(shape))
