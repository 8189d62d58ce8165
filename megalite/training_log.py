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
    """
    c = config
    h, s = c.hidden_size, c.seq_length
    attention = (1 + c.num_query_groups / c.num_attention_heads + s / h / 2) * (
        c.query_projection_size / h)
    mlp = _mlp_width(c) / h * (1.5 if c.swiglu else 1.0)
    logits = c.padded_vocab_size / (2 * c.num_layers * h)
    return 12 * batch_size * s * c.num_layers * h * h * (attention + mlp + logits)


def _mlp_width(c: GPTConfig) -> float:
    """The MLP width per layer, averaged over the layers, that a token's FLOPs see. A MoE
    layer counts its active parameters as Megatron does: the k routed experts a token goes
    to, plus the shared experts (the router's h x E GEMM is left out, as in Megatron)."""
    if c.num_experts is None:
        return c.ffn_hidden_size
    moe = sum(c.moe_layer_pattern)
    active = c.moe_ffn_hidden_size * c.moe_router_topk + (
        c.moe_shared_expert_intermediate_size or 0)
    return ((c.num_layers - moe) * c.ffn_hidden_size + moe * active) / c.num_layers


@dataclass
class IntervalStats:
    """Sums over the iterations since the last log line."""
    loss_sum: float = 0.0
    advanced_iters: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0
    elapsed_s: float = 0.0
    iters: int = 0

    def add(self, loss: float, skipped: bool, elapsed_s: float):
        self.iters += 1
        self.elapsed_s += elapsed_s
        if skipped:
            self.skipped_iters += 1
        else:
            self.advanced_iters += 1
            self.loss_sum += loss
        if not math.isfinite(loss):
            self.nan_iters += 1

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(1, self.advanced_iters)


def significant(value: float, digits: int = 4) -> str:
    """`value` to `digits` significant digits in fixed point, never in exponent form (a
    CPU run's TFLOP/s is ~1e-5: `.4g` would print 1.234e-05)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.1f}"
    decimals = max(1, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def log_line(*, iteration: int, train_iters: int, consumed_samples: int,
             elapsed_ms: float, tflops_per_gpu: float | None, learning_rate: float,
             global_batch_size: int, lm_loss: float, loss_scale: float,
             grad_norm: float | None, skipped_iters: int, nan_iters: int,
             tokens_per_second: float, mfu_percent: float | None = None,
             num_zeros: float | None = None, params_norm: float | None = None,
             memory_mib: dict[str, float] | None = None,
             scaling_efficiency_percent: float | None = None,
             compression_ratio: float | None = None,
             moe_losses: dict[str, float] | None = None,
             expert_load: float | None = None) -> str:
    """Megatron's training log line, field for field, then tokens per second; megalite's
    MFU after the throughput, the scaling efficiency after the tokens per second, with
    --grad-compression the last step's DP bytes uncompressed / sent, and the memory (MiB,
    max over ranks) at the end. With MoE layers Megatron's auxiliary losses follow the lm
    loss ("load_balancing_loss: ...", "z_loss: ..."), and megalite's expert load (most
    tokens of an expert over the mean, worst layer) follows them."""
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    line += f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    if tflops_per_gpu is not None:
        # Four significant digits rather than Megatron's one decimal: a CPU run is far
        # below 1 TFLOP/s and would print 0.0.
        line += f" throughput per GPU (TFLOP/s/GPU): {significant(tflops_per_gpu)} |"
    if mfu_percent is not None:
        line += f" MFU (%): {significant(mfu_percent)} |"
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    line += f" lm loss: {lm_loss:.6E} |"
    for name, value in (moe_losses or {}).items():
        line += f" {name}: {value:.6E} |"
    if expert_load is not None:
        line += f" expert load max/mean: {expert_load:.3f} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:
        line += f" num zeros: {num_zeros:.1f} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {skipped_iters:3d} |"
    line += f" number of nan iterations: {nan_iters:3d} |"
    line += f" tokens per second: {tokens_per_second:.1f} |"
    if scaling_efficiency_percent is not None:
        line += f" scaling efficiency (%): {scaling_efficiency_percent:.1f} |"
    if compression_ratio is not None:
        line += f" grad compression ratio: {compression_ratio:.1f} |"
    for name, mib in (memory_mib or {}).items():
        line += f" mem {name} (MiB): {mib:.1f} |"
    return line


# log_line's format read back: each field a named group, named as log_line's argument.
_E, _F = r"-?(?:\d\.\d{6}E[+-]\d\d|NAN|INF)", r"-?(?:[\d.]+|nan|inf)"  # .6E, .1f/.3f
_LOG_LINE = re.compile(
    r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(?P<iteration>\d+)/ +(?P<train_iters>\d+) \|"
    r" consumed samples: +(?P<consumed_samples>\d+) \|"
    rf" elapsed time per iteration \(ms\): (?P<elapsed_ms>{_F}) \|"
    rf"(?: throughput per GPU \(TFLOP/s/GPU\): (?P<tflops_per_gpu>{_F}) \|)?"
    rf"(?: MFU \(%\): (?P<mfu_percent>{_F}) \|)?"
    rf" learning rate: (?P<learning_rate>{_E}) \|"
    r" global batch size: +(?P<global_batch_size>\d+) \|"
    rf" lm loss: (?P<lm_loss>{_E}) \|"
    rf"(?P<moe_losses>(?: \w+_loss: {_E} \|)*)"
    rf"(?: expert load max/mean: (?P<expert_load>{_F}) \|)?"
    rf" loss scale: (?P<loss_scale>{_F}) \|"
    rf"(?: grad norm: (?P<grad_norm>{_F}) \|)?"
    rf"(?: num zeros: (?P<num_zeros>{_F}) \|)?"
    rf"(?: params norm: (?P<params_norm>{_F}) \|)?"
    r" number of skipped iterations: +(?P<skipped_iters>\d+) \|"
    r" number of nan iterations: +(?P<nan_iters>\d+) \|"
    rf" tokens per second: (?P<tokens_per_second>{_F}) \|"
    rf"(?: scaling efficiency \(%\): (?P<scaling_efficiency_percent>{_F}) \|)?"
    rf"(?: grad compression ratio: (?P<compression_ratio>{_F}) \|)?"
    rf"(?P<memory_mib>(?: mem [\w ]+ \(MiB\): {_F} \|)*)$")
_MEMORY = re.compile(rf" mem ([\w ]+) \(MiB\): ({_F}) \|")
_MOE_LOSS = re.compile(rf" (\w+_loss): ({_E}) \|")
_VALIDATION_LINE = re.compile(rf" validation loss at (?P<prefix>.*) \| lm loss value: "
                              rf"(?P<loss>{_E}) \| lm loss PPL: {_E} \|")


def parse_log_line(line: str) -> dict | None:
    """The fields of a log_line as log_line's keyword arguments (ints, floats; an optional
    field absent from the line is None, memory_mib a dict of MiB by name), or None if
    `line` is no log line. A prefix before the line (a launcher's) is skipped."""
    match = _LOG_LINE.search(line)
    if match is None:
        return None
    fields = {name: None if text is None else int(text) if text.isdigit() else float(text)
              for name, text in match.groupdict().items()
              if name not in ("memory_mib", "moe_losses")}
    fields["memory_mib"] = {name: float(mib) for name, mib in
                            _MEMORY.findall(match["memory_mib"])} or None
    fields["moe_losses"] = {name: float(value) for name, value in
                            _MOE_LOSS.findall(match["moe_losses"])} or None
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
            self.writer.flush()
            self.writer.close()
