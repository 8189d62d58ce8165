"""What context parallelism changes in a layer's activations (issue 14; docs/design.md §10).

Every [s, b, h] activation of a CP rank has s / CP rows (activations.py's `seq`), in two
chunks of c = s / (2 CP) rows; only the core attention differs, by --cp-comm-type
(megalite/context_parallel/attention.py):
- all_gather: the kernel keeps q (not this rank's k and v: they went into the gather), the
  K/V of the whole sequence gathered in sequence order ([2, b, s_full, kv] in the
  activation dtype; the two query chunks read prefixes of it), each query chunk's output
  (concatenated afterwards into a new tensor) and log-sum-exp, and under sdpa the mask of
  a query chunk shorter than its key prefix, in the activation dtype: c x (j + 1) c for
  chunk j, except chunk 0 (plain causal). Counted for CP rank >= 1, which holds no chunk 0
  (rank 0 keeps c^2 elements less). The unfused kernel instead repeats the prefix it
  reads: a rank's two chunks read (2 CP + 1) c keys and score (2 CP + 1) c^2 pairs.
- p2p (ring attention): the ring keeps q, k, v, its output (a separate [b, s, q] tensor
  from the output projection's contiguous input) and the fp32 log-sum-exp; the K/V blocks
  travelling round the ring live only while one layer's attention runs.
The transient buffers (the ring's blocks and gradient accumulators, or the gradient of the
gathered K/V) are a working set of one layer in backward, not saved per layer.
"""


def attended_keys(shape) -> tuple[int, int]:
    """(key rows the unfused kernel repeats, (query, key) pairs it scores) per head of one
    micro-batch row: s and s^2 without CP."""
    if shape.cp == 1:
        return shape.seq, shape.seq * shape.seq
    chunk_rows = shape.seq // 2
    return (2 * shape.cp + 1) * chunk_rows, (2 * shape.cp + 1) * chunk_rows * chunk_rows


def ring_keeps_qkv(config, shape) -> bool:
    """Ring attention saves q, k and v themselves, whatever the block kernel."""
    return shape.cp > 1 and config.model.cp_comm_type == "p2p"


def gathered_qkv_bytes(config, shape) -> int | None:
    """What the all_gather kernels (not unfused) keep of this rank's fused QKV output: q,
    a copy under RoPE or GQA, else a view keeping the whole fused output. None where
    activations.qkv_saved_bytes applies (CP 1, p2p, unfused)."""
    model = config.model
    if (shape.cp == 1 or model.cp_comm_type != "all_gather"
            or model.attention_backend == "unfused"):
        return None
    q_is_copy = (model.position_embedding_type == "rope"
                 or model.num_attention_heads != model.num_query_groups)
    width = shape.query_width if q_is_copy else shape.query_width + 2 * shape.kv_width
    return shape.act_bytes * shape.tokens * width


def cp_core_attention_bytes(config, shape) -> int | None:
    """Bytes the CP attention keeps beyond q, k, v and the output projection's input; None
    for the unfused all_gather kernel, which activations._unfused_attention_bytes counts
    with `attended_keys`."""
    lse, out = 4 * shape.heads * shape.tokens, shape.act_bytes * shape.tokens * shape.query_width
    if config.model.cp_comm_type == "p2p":
        return lse + out
    if config.model.attention_backend == "unfused":
        return None
    gathered = 2 * shape.act_bytes * shape.cp * shape.tokens * shape.kv_width
    chunk_rows = shape.seq // 2
    # "auto" is sdpa on the CPU; on a GPU it is flash where installed, which needs no mask.
    backend = config.model.attention_backend
    sdpa = backend == "sdpa" or (backend == "auto" and shape.device.name == "cpu")
    mask = shape.act_bytes * chunk_rows * chunk_rows * (2 * shape.cp + 1) if sdpa else 0
    return lse + out + gathered + mask


def cp_attention_working_set(config, shape) -> int:
    """One layer's transient CP buffers in backward: p2p holds a K/V block and the next
    one arriving, an fp32 dK/dV accumulator and the one arriving, and an fp32 dQ; all_gather
    the gradient of the gathered K/V before its reduce-scatter."""
    if shape.cp == 1:
        return 0
    kv_block = 2 * shape.act_bytes * shape.tokens * shape.kv_width
    if config.model.cp_comm_type == "p2p":
        accumulator = 2 * max(shape.act_bytes, 4) * shape.tokens * shape.kv_width
        return 2 * kv_block + 2 * accumulator + 4 * shape.tokens * shape.query_width
    return kv_block * shape.cp
