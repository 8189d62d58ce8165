"""What context parallelism changes in a layer's activations (issue 14; docs/design.md §10).

Every [s, b, h] activation of a CP rank has s / CP rows (activations.py's `s`); only the
core attention differs, by --cp-comm-type (megalite/context_parallel/attention.py):
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


def attended_keys(x) -> tuple[int, int]:
    """(key rows the unfused kernel repeats, (query, key) pairs it scores) per head of one
    micro-batch row: s and s^2 without CP."""
    if x.cp == 1:
        return x.s, x.s * x.s
    c = x.s // 2  # two chunks of c rows per rank
    return (2 * x.cp + 1) * c, (2 * x.cp + 1) * c * c


def ring_keeps_qkv(config, x) -> bool:
    """Ring attention saves q, k and v themselves, whatever the block kernel."""
    return x.cp > 1 and config.model.cp_comm_type == "p2p"


def gathered_qkv_bytes(config, x) -> int | None:
    """What the all_gather kernels (not unfused) keep of this rank's fused QKV output: q,
    a copy under RoPE or GQA, else a view keeping the whole fused output. None where
    activations.qkv_saved_bytes applies (CP 1, p2p, unfused)."""
    m = config.model
    if x.cp == 1 or m.cp_comm_type != "all_gather" or m.attention_backend == "unfused":
        return None
    q_is_copy = m.position_embedding_type == "rope" or m.num_attention_heads != m.num_query_groups
    return x.a * x.s * x.b * (x.q if q_is_copy else x.q + 2 * x.kv)


def cp_core_attention_bytes(config, x) -> int | None:
    """Bytes the CP attention keeps beyond q, k, v and the output projection's input; None
    for the unfused all_gather kernel, which activations._unfused_attention_bytes counts
    with `attended_keys`."""
    lse, out = 4 * x.b * x.heads * x.s, x.a * x.b * x.s * x.q
    if config.model.cp_comm_type == "p2p":
        return lse + out
    if config.model.attention_backend == "unfused":
        return None
    gathered = 2 * x.a * x.b * x.cp * x.s * x.kv
    c = x.s // 2
    # "auto" is sdpa on the CPU; on a GPU it is flash where installed, which needs no mask.
    backend = config.model.attention_backend
    sdpa = backend == "sdpa" or (backend == "auto" and x.device.name == "cpu")
    mask = x.a * c * c * (2 * x.cp + 1) if sdpa else 0
    return lse + out + gathered + mask


def cp_attention_working_set(config, x) -> int:
    """One layer's transient CP buffers in backward: p2p holds a K/V block and the next
    one arriving, an fp32 dK/dV accumulator and the one arriving, and an fp32 dQ; all_gather
    the gradient of the gathered K/V before its reduce-scatter."""
    if x.cp == 1:
        return 0
    kv_block = 2 * x.a * x.b * x.s * x.kv
    if config.model.cp_comm_type == "p2p":
        accumulator = 2 * max(x.a, 4) * x.b * x.s * x.kv
        return 2 * kv_block + 2 * accumulator + 4 * x.b * x.s * x.q
    return kv_block * x.cp
