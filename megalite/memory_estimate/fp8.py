"""What FP8 changes in one transformer layer's memory (tensor_parallel/fp8.py): under the
tensorwise recipe each of its four linear layers keeps the FP8 copy of its input (one byte
an element, transposed for dA's GEMM) instead of the input itself, for every micro-batch in
flight, and two FP8 copies of its weight shard, A and A^T for the forward's and dX's GEMMs,
with the two fp32 scales once a step (fp8.quantize_weights_once keeps them from the first
micro-batch's forward to the step's last backward). The rowwise recipe keeps what the plain
layer keeps (its input and the weight itself) and quantizes again in backward."""

from megalite.config import Config
from megalite.tensor_parallel.fp8 import layer_fp8_recipe

SCALES_PER_LINEAR = 2  # X's and A's, 0-dim fp32
WEIGHT_LAYOUTS = 2  # A and A^T, each row-major: cuBLASLt's FP8 GEMM wants both (fp8.scaled_mm)


def fp8_weight_copy_bytes(config: Config, shape, layer: int) -> int:
    """The FP8 copies of transformer layer `layer`'s four weight shards in both layouts and
    their scales, held through a step's forwards and backwards (`shape`: the planner's
    activations._Shapes)."""
    if _plain(config, layer):
        return 0
    h, q, kv, f = shape.hidden, shape.query_width, shape.kv_width, shape.ffn_width
    fc1 = 2 * f if config.model.swiglu else f
    weights = h * (q + 2 * kv) + q * h + h * fc1 + f * h
    return WEIGHT_LAYOUTS * weights + 4 * SCALES_PER_LINEAR * 4


def fp8_layer_delta_bytes(config: Config, shape, layer: int) -> int:
    """Bytes transformer layer `layer` saves per micro-batch in FP8 minus what it saves
    without, its weight copies aside (fp8_weight_copy_bytes)."""
    if _plain(config, layer):
        return 0
    h, q, f = shape.hidden, shape.query_width, shape.ffn_width
    # Inputs kept by their linear layer only: of QKV and fc1 (norm outputs, gathered under
    # SP) and fc2. The projection's input is the attention kernel's saved output itself
    # where the fused kernel lays it out [s, b, ...] (CPU): FP8 adds its copy there.
    freed, kept = shape.tokens * (2 * h + f), 0
    if shape.device.attention_output_copied or config.model.attention_backend == "unfused":
        freed += shape.tokens * q
    else:
        kept += shape.tokens * q
    return kept - (shape.act_bytes - 1) * freed


def _plain(config: Config, layer: int) -> bool:
    """Whether the layer keeps what a layer without FP8 keeps: no FP8 recipe, or rowwise."""
    recipe = layer_fp8_recipe(config.model, layer)
    return recipe is None or recipe.rowwise
