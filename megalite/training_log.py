"""What training reports: Megatron's log line (and its parser), its FLOPs count, and
TensorBoard scalars."""

import math
import re
from dataclasses import dataclass
from datetime import datetime

from megalite.config import GPTConfig


def num_floating_point_operations(config: GPTConfig, batch_size: int) -> float:
    """Training FLOPs of one step over `batch_size` sequences (Megatron-LM's count for a
    dense GPT; Narayanan et al. 2021, appendix).

    Every GEMM runs 3 times (forward, grad of input, grad of weight) at 2 FLOPs per
    multiply-add, and the per-layer GEMMs come in pairs, hence the factor 12 = 3 x 2 x 2:

        12 B s L h^2 [ (1 + g/n + s/(2h)) q/h  +  (f/h) x (3/2 with SwiGLU)  +  V/(2 L h) ]

    with B sequences of length s, L layers, hidden h, n heads, g query groups,
    q = n x kv_channels the query projection width, f the MLP width and V the padded
    vocabulary. Inside the attention bracket: Q and output projections (1), K and V (g/n),
    and the attention core QK^T and softmax x V, of which a causal mask leaves half (s/2h).
    The last term is the logit layer. The count is the model's, the same at any layout: a
    context-parallel rank computes only its causal share of the attention core (ring
    attention skips the fully masked blocks), so the log divides it by the world size.
    Document masks (--reset-attention-mask) leave the count full causal, as Megatron's
    (docs/design.md §28). Multi-latent attention replaces the attention bracket by
    Megatron's MLA count (_mla_attention).

    Multi-token prediction (D = --mtp-num-layers) counts as Megatron's does: the D depths'
    transformer layers join L (dense or MoE as the last layer), the logit layer runs D + 1
    times, and each depth adds its norms and eh_proj, 6 B s (3h + 2h^2) (docs/design.md §33).
    """
    c = config
    h, s, depths = c.hidden_size, c.seq_length, c.mtp_depths
    layers = c.num_layers + depths
    attention = (1 + c.num_query_groups / c.num_attention_heads + s / h / 2) * (
        c.query_projection_size / h)
    if c.multi_latent_attention:
        attention = _mla_attention(c) / (12 * h * h)
    mlp = _mlp_width(c) / h * (1.5 if c.swiglu else 1.0)
    logits = c.padded_vocab_size * (1 + depths) / (2 * layers * h)
    mtp = depths * (3 * h + 2 * h * h) / (2 * layers * h * h)
    return 12 * batch_size * s * layers * h * h * (attention + mlp + logits + mtp)


def _mla_attention(c: GPTConfig) -> float:
    """Training FLOPs per token of one multi-latent attention layer, Megatron's count
    (training.py): 3 passes x 2 FLOPs per multiply-add over the projections (the query
    latent's down and up, or linear_q_proj; the key/value latent's down and up; the shared
    RoPE key; linear_proj; the "+ 1" per latent rank is Megatron's for its norm) and over
    the causal half of QK^T (heads x the whole q/k head) and of softmax x V (heads x v)."""
    h, n, s = c.hidden_size, c.num_attention_heads, c.seq_length
    q_head = c.qk_head_dim + c.qk_pos_emb_head_dim
    q_term = h * n * q_head if c.q_lora_rank is None else c.q_lora_rank * (h + n * q_head + 1)
    projections = (q_term + c.kv_lora_rank * (h + n * (c.qk_head_dim + c.v_head_dim) + 1)
                   + h * c.qk_pos_emb_head_dim + n * c.v_head_dim * h)
    core = s * (n * q_head + n * c.v_head_dim) / 2
    return 6 * (projections + core)


def _mlp_width(c: GPTConfig) -> float:
    """The MLP width per layer, averaged over the layers and the MTP depths' layers, that a
    token's FLOPs see. A MoE layer counts its active parameters as Megatron does: the k
    routed experts a token goes to, plus the shared experts (the router's h x E GEMM is
    left out, as in Megatron)."""
    if c.num_experts is None:
        return c.ffn_hidden_size
    layers = c.num_layers + c.mtp_depths
    moe = sum(c.moe_layer_pattern) + c.mtp_depths * c.moe_layer_pattern[-1]
    active = c.moe_ffn_hidden_size * c.moe_router_topk + (
        c.moe_shared_expert_intermediate_size or 0)
    return ((layers - moe) * c.ffn_hidden_size + moe * active) / layers


@dataclass
class IntervalStats:
    """Sums over the iterations since the last log line."""
    loss_sum: float = 0.0
    advanced_iters: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0
    elapsed_s: float = 0.0
    iters: int = 0
    mtp_loss_sums: list[float] | None = None

    def add(self, loss: float, skipped: bool, elapsed_s: float,
            mtp_losses: list[float] | None = None):
        self.iters += 1
        self.elapsed_s += elapsed_s
        if skipped:
            self.skipped_iters += 1
        else:
            self.advanced_iters += 1
            self.loss_sum += loss
            if mtp_losses is not None:
                self.mtp_loss_sums = [a + b for a, b in
                                      zip(self.mtp_loss_sums or [0.0] * len(mtp_losses),
                                          mtp_losses)]
        if not math.isfinite(loss):
            self.nan_iters += 1

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(1, self.advanced_iters)

    @property
    def mtp_losses(self) -> dict[str, float] | None:
        """Megatron's "mtp_k loss" of each depth k, averaged over the advanced iterations
        (the log line's keys: k)."""
        if self.mtp_loss_sums is None:
            return None
        return {str(k + 1): s / self.advanced_iters for k, s in enumerate(self.mtp_loss_sums)}


def significant(value: float, digits: int = 4) -> str:
    """`value` to `digits` significant digits in fixed point, never in exponent form (a
    CPU run's TFLOP/s is ~1e-5: `.4g` would print 1.234e-05)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.1f}"
    decimals = max(1, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


# The log line after its timestamp and iteration, in order: (log_line's argument, Megatron's
# label, format). A field whose value is None is left out; a dict prints an item per key,
# the key in place of the label's {}. TFLOP/s and MFU have four significant digits rather
# than Megatron's one decimal: a CPU run is far below 1 TFLOP/s and would print 0.0.
FIELDS = (
    ("consumed_samples", "consumed samples", "12d"),
    ("elapsed_ms", "elapsed time per iteration (ms)", ".1f"),
    ("tflops_per_gpu", "throughput per GPU (TFLOP/s/GPU)", "significant"),
    ("mfu_percent", "MFU (%)", "significant"),  # megalite's
    ("learning_rate", "learning rate", ".6E"),
    ("global_batch_size", "global batch size", "5d"),
    ("lm_loss", "lm loss", ".6E"),
    # Megatron's "mtp_1 loss: ..." (it prints them after the MoE losses; here before, so
    # that the MoE losses' bare keys cannot read them back)
    ("mtp_losses", "mtp_{} loss", ".6E"),
    ("moe_losses", "{}", ".6E"),  # Megatron's auxiliary losses, "load_balancing_loss: ..."
    ("expert_load", "expert load max/mean", ".3f"),  # megalite's: worst layer's max / mean
    ("loss_scale", "loss scale", ".1f"),
    ("grad_norm", "grad norm", ".3f"),
    ("num_zeros", "num zeros", ".1f"),
    ("params_norm", "params norm", ".3f"),
    ("skipped_iters", "number of skipped iterations", "3d"),
    ("nan_iters", "number of nan iterations", "3d"),
    ("tokens_per_second", "tokens per second", ".1f"),
    ("scaling_efficiency_percent", "scaling efficiency (%)", ".1f"),  # megalite's from here
    ("compression_ratio", "grad compression ratio", ".1f"),  # DP bytes uncompressed / sent
    # Bytes a rank sends across replicas per step under hybrid sharding (N > 1)
    ("cross_replica_bytes", "cross-replica bytes per step", ".1f"),
    ("memory_mib", "mem {} (MiB)", ".1f"),  # max over ranks
)
_E = r"-?(?:\d\.\d{6}E[+-]\d\d|NAN|INF)"  # what .6E prints


def log_line(*, iteration: int, train_iters: int, **fields) -> str:
    """Megatron's training log line: the iteration, then FIELDS, each of `fields` not None."""
    if unknown := fields.keys() - {name for name, _, _ in FIELDS}:
        raise TypeError(f"log_line got fields it does not print: {sorted(unknown)}")
    line = f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{train_iters:8d} |"
    for name, label, fmt in FIELDS:
        value = fields.get(name)
        items = (value or {}).items() if "{}" in label else [(None, value)]
        for key, v in items:
            if v is not None:
                number = significant(v) if fmt == "significant" else format(v, fmt)
                line += f" {label.format(key)}: {number} |"
    return line


def _item(label: str, fmt: str, group: str) -> str:
    """A regex of one item log_line prints for a field, its number inside `group` (a
    pattern holding {}); a dict field's key, in place of the label's {}, a group before it."""
    number = {"d": r"\d+", "E": _E}.get(fmt[-1], r"-?(?:[\d.]+|nan|inf)")
    label = r"([\w ]+)".join(re.escape(part) for part in label.split("{}"))
    return rf" {label}: *{group.format(number)} \|"


# log_line read back from FIELDS: each field optional, a dict's items one group.
_LOG_LINE = re.compile(
    r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(?P<iteration>\d+)/ +(?P<train_iters>\d+) \|"
    + "".join(rf"(?P<{name}>(?:{_item(label, fmt, '{}')})*)" if "{}" in label
              else rf"(?:{_item(label, fmt, f'(?P<{name}>{{}})')})?"
              for name, label, fmt in FIELDS) + "$")
_ITEMS = {name: re.compile(_item(label, fmt, "({})")) for name, label, fmt in FIELDS
          if "{}" in label}
_VALIDATION_LINE = re.compile(rf" validation loss at (?P<prefix>.*) \| lm loss value: "
                              rf"(?P<loss>{_E}) \| lm loss PPL: {_E} \|")


def parse_log_line(line: str) -> dict | None:
    """The fields of a log_line as log_line's keyword arguments (ints, floats, a dict of
    floats by key; a field absent from the line None), or None if `line` is no log line. A
    prefix before the line (a launcher's) is skipped."""
    match = _LOG_LINE.search(line)
    if match is None:
        return None
    fields = {"iteration": int(match["iteration"]), "train_iters": int(match["train_iters"])}
    for name, _, fmt in FIELDS:
        text = match[name]
        if name in _ITEMS:
            fields[name] = {key: float(v) for key, v in _ITEMS[name].findall(text)} or None
        else:
            fields[name] = None if text is None else int(text) if fmt[-1] == "d" else float(text)
    return fields


def parse_log(text: str) -> list[dict]:
    """parse_log_line of each log line of `text` (a run's output), in order."""
    return [fields for fields in map(parse_log_line, text.splitlines()) if fields]


def parse_validation_line(line: str) -> dict | None:
    """validation_lines' arguments, {"prefix", "loss"}, read back from its middle line."""
    match = _VALIDATION_LINE.search(line)
    return None if match is None else {"prefix": match["prefix"], "loss": float(match["loss"])}


def validation_lines(prefix: str, loss: float) -> list[str]:
    """Megatron's boxed validation report; perplexity capped at exp(20) as Megatron does."""
    body = (f" validation loss at {prefix} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {math.exp(min(20.0, loss)):.6E} | ")
    rule = "-" * (len(body) + 1)
    return [rule, body, rule]


class TensorBoardLogger:
    """Scalars under Megatron's tag names; a no-op without --tensorboard-dir."""

    def __init__(self, log_dir: str | None):
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard
            self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def scalars(self, iteration: int, values: dict):
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, iteration)

    def close(self):
        if self.writer is not None:
            self.writer.close()  # flushes
