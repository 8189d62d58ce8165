"""FP8 linear layers (megalite/tensor_parallel/fp8.py) against a reference written here from
the formula: each operand quantized as q = clamp(t / s, +-fp8_max) in FP8, s = amax /
fp8_max (per tensor, or per row along the GEMM's contraction dim), dequantized (q * s) in
fp32, then multiplied in fp32. The flags that turn it on and what they refuse."""

import contextlib
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megalite.arguments import parse_args
from megalite.config import OptimizerConfig
from megalite.errors import ConfigError
from megalite.model.gpt import GPTModel
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import fp8
from megalite.tensor_parallel.fp8 import Fp8Recipe
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.weight_grad import WeightGradStore
from megalite.train_step import StepRunner
from megalite.training import pretrain
from megalite.training_log import parse_log
from megalite.validation import validate_args

from tests.helpers import (checkpoint_tensors, flags_with, random_batches, step_config,
                           tiny_gpt_config)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = [Fp8Recipe("e4m3", "tensorwise"), Fp8Recipe("hybrid", "tensorwise"),
           Fp8Recipe("e4m3", "rowwise")]


def dequantized(t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> torch.Tensor:
    """t rounded through FP8 `dtype` with scale amax / max (over `dim`, or the tensor)."""
    t = t.double()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (amax.clamp(min=1e-12) / torch.finfo(dtype).max).float().double()
    q = (t / scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).float().to(dtype)
    return q.double() * scale


def reference(x, w, b, g, recipe: Fp8Recipe):
    """(y, dx, dw, db) of y = x w^T + b for output gradient g, every GEMM's operands
    rounded through FP8 as the recipe says."""
    grad_dtype = E5M2 if recipe.format == "hybrid" else E4M3
    x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    if recipe.rowwise:  # scales along each GEMM's contraction dim
        y = dequantized(x, E4M3, 1) @ dequantized(w, E4M3, 1).T
        dx = dequantized(g, grad_dtype, 1) @ dequantized(w, E4M3, 0)
        dw = dequantized(g, grad_dtype, 0).T @ dequantized(x, E4M3, 0)
    else:
        xq, wq, gq = dequantized(x, E4M3, None), dequantized(w, E4M3, None), \
            dequantized(g, grad_dtype, None)
        y, dx, dw = xq @ wq.T, gq @ wq, gq.T @ xq
    return y + b.double(), dx, dw, g.double().sum(0)


def _close(actual, expected):
    torch.testing.assert_close(actual.double().reshape(expected.shape), expected,
                               rtol=1e-5, atol=1e-5)


def layer_case(kind, recipe: Fp8Recipe):
    """An FP8 layer 32 -> 48 with random weight and bias, an input x [8, 2, 32] and an
    output gradient g."""
    generator = torch.Generator().manual_seed(0)
    layer = kind(32, 48, group=None, fp8=recipe)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 32, generator=generator))
        layer.bias.copy_(torch.randn(48, generator=generator))
    # Rows of very different size, so a rowwise scale differs from a tensorwise one.
    x = (torch.randn(8, 2, 32, generator=generator)
         * torch.logspace(-2, 1, 8).view(8, 1, 1)).requires_grad_()
    return layer, x, torch.randn(8, 2, 48, generator=generator) * 1e-3


LAYER_CASES = pytest.mark.parametrize("kind, recipe", [
    (kind, recipe) for kind in (ColumnParallelLinear, RowParallelLinear) for recipe in RECIPES],
    ids=lambda v: f"{v.format}-{v.recipe}" if isinstance(v, Fp8Recipe) else v.__name__)


@LAYER_CASES
def test_fp8_layer_forward_backward_match_the_formula(kind, recipe):
    layer, x, g = layer_case(kind, recipe)
    y = layer(x)
    y.backward(g)
    ref_y, ref_dx, ref_dw, ref_db = reference(x.detach(), layer.weight.detach(),
                                              layer.bias.detach(), g, recipe)
    _close(y, ref_y)
    _close(x.grad, ref_dx)
    _close(layer.weight.grad, ref_dw)
    _close(layer.bias.grad, ref_db)
    # And FP8 is near the exact product (a wrong scale would be far from it).
    exact = x.detach() @ layer.weight.detach().T + layer.bias.detach()
    assert (y - exact).norm() < 0.1 * exact.norm()


def fp32_formula(x, w, b, g, recipe: Fp8Recipe):
    """(y, dx, dw, db) in fp32 as the FP8 layer computed them before its quantizations
    wrote transposed copies: each operand quantized on its own, dequantized (q * s), then
    multiplied in fp32 (what torch._scaled_mm does on a CPU)."""
    def rounded(t, dtype, dim):
        fp8_max = torch.finfo(dtype).max
        amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
        scale = amax.clamp(min=1e-12) / fp8_max
        return (t / scale).clamp(-fp8_max, fp8_max).to(dtype).float() * scale
    grad_dtype = E5M2 if recipe.format == "hybrid" else E4M3
    x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dims = (1, 1, 1, 0, 0, 0) if recipe.rowwise else (None,) * 6  # along each contraction
    y = rounded(x, E4M3, dims[0]) @ rounded(w, E4M3, dims[1]).T
    dx = rounded(g, grad_dtype, dims[2]) @ rounded(w, E4M3, dims[3])
    dw = rounded(g, grad_dtype, dims[4]).T @ rounded(x, E4M3, dims[5])
    return y + b, dx, dw, g.sum(0)


@LAYER_CASES
def test_fp8_layer_equals_quantize_dequantize_matmul_bit_for_bit(kind, recipe):
    """The quantizations that write transposed copies for the GEMMs change layouts only:
    the same scales and codes, so in fp32 on a CPU the same bits as the formula."""
    layer, x, g = layer_case(kind, recipe)
    y = layer(x)
    y.backward(g)
    expected = fp32_formula(x.detach(), layer.weight.detach(), layer.bias.detach(), g, recipe)
    actual = (y, x.grad, layer.weight.grad, layer.bias.grad)
    for name, got, want in zip(("y", "dx", "dw", "db"), actual, expected):
        assert torch.equal(got.reshape(want.shape), want), name


@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_transpose_writes_the_transposed_codes_row_major(dtype, dim):
    """quantize_both's second copy and quantize_transposed are quantize's codes and scales
    transposed, bit for bit, laid out row-major (a bf16 input cast in the same pass)."""
    t = (torch.randn(48, 32) * torch.logspace(-3, 2, 32)).to(torch.bfloat16)
    plain = fp8.quantize(t, dtype, dim)
    for q, q_t in (fp8.quantize_both(t, dtype, dim), (plain, fp8.quantize_transposed(t, dtype,
                                                                                     dim))):
        assert q_t.data.is_contiguous() and q_t.data.shape == (32, 48)
        assert torch.equal(q.data.view(torch.uint8), plain.data.view(torch.uint8))
        assert torch.equal(q_t.data.view(torch.uint8), plain.data.t().view(torch.uint8))
        assert torch.equal(q.scale, plain.scale) and torch.equal(q_t.scale, plain.scale.t())


def test_scaled_mm_copies_operands_passed_in_other_layouts():
    """A caller's a column-major or b row-major is copied into cuBLASLt's layout, not
    refused: the same product as with the operands laid out for it."""
    a = fp8.quantize(torch.randn(16, 32), E4M3)
    b = fp8.quantize_transposed(torch.randn(32, 48), E4M3).t()  # [32, 48] column-major
    want = fp8.scaled_mm(a, b, torch.float32)
    a_col = fp8.Quantized(a.data.t().contiguous().t(), a.scale)
    b_row = fp8.Quantized(b.data.contiguous(), b.scale)
    assert torch.equal(fp8.scaled_mm(a_col, b_row, torch.float32), want)


class Fp8Ops(TorchDispatchMode):
    """Records the aten ops that take an FP8 tensor, with the layouts of their inputs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.dtype in (E4M3, E5M2) for t in tensors):
            self.ops.append((func, [(t.dtype, t.shape, t.stride()) for t in tensors]))
        return func(*args, **(kwargs or {}))


@LAYER_CASES
@pytest.mark.parametrize("once", [False, True], ids=["uncached", "weights-once"])
def test_fp8_layer_makes_no_copy_of_an_fp8_tensor(kind, recipe, once):
    """Every GEMM operand is quantized straight into cuBLASLt's layout (fp8.scaled_mm), so
    FP8 tensors are only viewed (transposed) and multiplied: no clone, contiguous or cast
    of FP8 codes, over two micro-batches' forwards and backwards (the second reusing the
    step's weight copies under quantize_weights_once)."""
    layer, x, g = layer_case(kind, recipe)
    with Fp8Ops() as seen, (fp8.quantize_weights_once(layer.linear_step) if once
                            else contextlib.nullcontext()):
        for _ in range(2):
            layer(x).backward(g)
    copies = [(func, inputs) for func, inputs in seen.ops
              if not func.is_view and func is not torch.ops.aten._scaled_mm.default]
    assert not copies, copies
    assert sum(func is torch.ops.aten._scaled_mm.default for func, _ in seen.ops) == 6


def test_fp8_weight_gradient_deferred_to_the_w_pass_equals_the_direct_one():
    generator = torch.Generator().manual_seed(1)
    layer = ColumnParallelLinear(32, 16, group=None, fp8=RECIPES[1])
    with torch.no_grad():
        layer.weight.normal_(generator=generator)
    x = torch.randn(4, 2, 32, generator=generator, requires_grad=True)
    layer(x).square().sum().backward()
    direct = layer.weight.grad.clone()
    layer.weight.grad = None
    store = WeightGradStore()
    with layer.linear_step.defer_weight_grads(store):
        layer(x).square().sum().backward()
    assert layer.weight.grad is None and len(store.pending) == 1
    store.run()
    assert torch.equal(layer.weight.grad, direct)


def test_first_last_layers_bf16_keeps_those_layers_out_of_fp8():
    config = tiny_gpt_config(num_layers=4, fp8_format="hybrid", first_last_layers_bf16=True,
                             num_layers_at_end_in_bf16=2)
    model = GPTModel(config, seed=0)
    recipes = [layer.mlp.linear_fc1.fp8 for layer in model.decoder.layers.values()]
    assert recipes == [None, Fp8Recipe("hybrid", "tensorwise"), None, None]
    layer = model.decoder.layers["1"]
    assert layer.self_attention.linear_qkv.fp8 == layer.self_attention.linear_proj.fp8 \
        == layer.mlp.linear_fc2.fp8 == recipes[1]
    assert model.output_layer is None or model.output_layer.fp8 is None


@pytest.mark.parametrize("extra, message", [
    (["--fp8-format", "hybrid", "--fp8-recipe", "delayed"], "delayed is Megatron's"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], "mxfp8 is Megatron's"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"], "use --fp8-format e4m3"),
    (["--fp8-format", "e4m3", "--context-parallel-size", "2"], "--context-parallel-size 2"),
    (["--first-last-layers-bf16"], "needs --fp8-format"),
    (["--fp8-format", "e4m3", "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "1",
      "--num-layers-at-start-in-bf16", "1"], "leave at least one"),
])
def test_fp8_flags_refused_by_name(extra, message):
    with pytest.raises(ConfigError, match=message):
        validate_args(parse_args(flags_with(*extra)), world_size=2)


def test_fp8_flags_reach_the_model_config():
    config = validate_args(parse_args(flags_with("--fp8-format", "e4m3", "--fp8-recipe",
                                                 "rowwise")))
    assert (config.model.fp8_format, config.model.fp8_recipe) == ("e4m3", "rowwise")


CHECKPOINT_FLAGS = flags_with("--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                              "--attention-dropout", "0", "--hidden-dropout", "0",
                              vocab_size=61, make_vocab_size_divisible_by=None, hidden_size=32,
                              seq_length=16, micro_batch_size=2, global_batch_size=4,
                              train_iters=3, lr="3e-3")


def _pretrain(capsys, *flags) -> dict[int, float]:
    """pretrain_gpt.py in this process (fp32 master weights on the CPU): {iteration: loss}."""
    capsys.readouterr()
    assert pretrain([*CHECKPOINT_FLAGS, *flags]) == 0
    return {log["iteration"]: log["lm_loss"] for log in parse_log(capsys.readouterr().out)}


def _layout(tensors: dict) -> dict:
    return {key: (value.shape, value.dtype) if torch.is_tensor(value) else type(value)
            for key, value in tensors.items()}


def test_fp8_and_plain_runs_resume_from_each_other(tmp_path, capsys):
    """An FP8 checkpoint holds what a plain one holds (master weights and optimizer state in
    their own dtypes, nothing of FP8); a plain run resumes from it, and an FP8 run from the
    plain run's checkpoint."""
    fp8_flags = ["--fp8-format", "hybrid"]
    first = _pretrain(capsys, *fp8_flags, "--save", str(tmp_path / "fp8"), "--train-iters", "2")
    second = _pretrain(capsys, "--load", str(tmp_path / "fp8"), "--save", str(tmp_path / "plain"))
    third = _pretrain(capsys, *fp8_flags, "--load", str(tmp_path / "plain"), "--train-iters", "4")
    assert (list(first), list(second), list(third)) == ([1, 2], [3], [4])
    assert _layout(checkpoint_tensors(tmp_path / "fp8")) == \
        _layout(checkpoint_tensors(tmp_path / "plain"))


def test_weights_quantized_once_a_step_give_the_per_micro_batch_results(monkeypatch, capsys):
    """train_step's quantize_weights_once against the layer quantizing its weight at every
    micro-batch (the cache made a no-op): the same losses, bit for bit, over 4 micro-batches
    a step under full recompute, and one weight quantization (its cast-transpose, both
    layouts) per linear layer and step instead of two (forward and recomputed forward) per
    micro-batch."""
    flags = ["--fp8-format", "hybrid", "--global-batch-size", "8", "--recompute-granularity",
             "full", "--recompute-method", "uniform"]
    weights = []
    real = fp8.quantize_both

    def counting(t, dtype, dim=None, group=None):
        weights.append(isinstance(t, torch.nn.Parameter))
        return real(t, dtype, dim, group)
    monkeypatch.setattr(fp8, "quantize_both", counting)
    cached = _pretrain(capsys, *flags)
    cached_casts = sum(weights)
    weights.clear()
    monkeypatch.setattr("megalite.train_step.quantize_weights_once", contextlib.nullcontext)
    uncached = _pretrain(capsys, *flags)
    assert cached == uncached
    linears, steps = 4 * 2, 3  # 2 layers (flags_with), train_iters 3
    assert cached_casts == linears * steps
    assert sum(weights) == 2 * 4 * linears * steps


def _fp8_runner(seed: int) -> StepRunner:
    """A tiny FP8 model (tensorwise, so its weights are quantized once a step) and its
    runner: 2 micro-batches of 2 sequences a step."""
    config = tiny_gpt_config(fp8_format="hybrid")
    model = GPTModel(config, seed=seed)
    return StepRunner(torch.nn.ModuleList([model]), Optimizer(model, OptimizerConfig(lr=1e-2)),
                      step_config(config, 2, 2), ParallelState.single_process(),
                      torch.device("cpu"))


def _teacher_rounds(teacher: StepRunner, rounds: int) -> list[float]:
    """`rounds` times: the teacher's evaluation loss, then one step of its own."""
    generator = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(rounds):
        batches = random_batches(generator, 64, 2, 8, 2)
        losses += [teacher.evaluate(batches)[0], teacher.train_step(batches).loss]
    return losses


def test_two_models_keep_their_own_fp8_weight_copies():
    """Two FP8 models in one process, each with its runner: a teacher evaluated and stepped
    by its own runner inside the student's step (from a forward hook, where a distillation
    loss would read it) equals the teacher run alone, bit for bit. The copies a step keeps
    belong to its model: with one module-level cache, the teacher's evaluation left its FP8
    weights in the student's step and its next evaluation reused them after the teacher's
    own step had changed the weights."""
    alone = _teacher_rounds(_fp8_runner(seed=3), rounds=2)
    student, teacher = _fp8_runner(seed=1), _fp8_runner(seed=3)
    inside = []
    generator = torch.Generator().manual_seed(7)

    def run_teacher(module, args, output):  # at each of the student's 2 micro-batches
        batches = random_batches(generator, 64, 2, 8, 2)
        inside.extend([teacher.evaluate(batches)[0], teacher.train_step(batches).loss])
    student.chunks[0].register_forward_hook(run_teacher)
    student.train_step(random_batches(torch.Generator().manual_seed(0), 64, 2, 8, 2))
    assert inside == alone


@pytest.mark.parametrize("capability, shapes, message", [
    ((8, 0), ((32, 32), (32, 32)), "compute capability >= 8.9.*has 8.0"),
    ((9, 0), ((24, 32), (32, 32)), r"\[24, 32\] x \[32, 32\] has a dim that is not a multiple"),
])
def test_fp8_gemm_refused_on_gpus_that_cannot_run_it(monkeypatch, capability, shapes, message):
    monkeypatch.setattr(fp8, "_capability", lambda device: capability)
    with pytest.raises(ConfigError, match=message):
        fp8.check_fp8_device("cuda:0")
        fp8._check_dims(*shapes)


def test_fp8_linears_traced_into_compiled_layers_equal_eager_ones(monkeypatch):
    """--compile-layers with FP8 at TP 1: the FP8 linears are traced into each layer's graph
    (no graph break) and the gradients equal the eager FP8 model's. aot_eager runs the same
    capture (dynamo, AOTAutograd) as inductor with eager kernels; inductor itself was run
    on the CPU once (2 minutes) with the same result."""
    from torch._dynamo.utils import counters
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    shape = dict(num_layers=2, fp8_format="hybrid", swiglu=True, normalization="RMSNorm",
                 position_embedding_type="rope", add_bias_linear=False, seq_length=16)
    models = [GPTModel(tiny_gpt_config(compile_layers=compiled, **shape), seed=2)
              for compiled in (True, False)]
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for model in models:
        model(tokens, tokens).mean().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0  # the layers were compiled
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


NEEDS_FP8_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
# On a GPU the quantization is compiled: inductor starts its compile workers (processes).


@NEEDS_FP8_GPU
@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.format}-{r.recipe}")
@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
def test_fp8_layer_on_the_gpu_matches_the_formula(kind, recipe):
    """cuBLASLt's FP8 GEMMs and the compiled quantization (fp8._kernel) against the formula
    in fp64, in bf16: the output is rounded to bf16 once, so 1% of the tensor in norm. An
    element may be off by more: the formula divides in fp64, the kernel in fp32, and now
    and then an operand lands on the other side of an FP8 rounding boundary (seen on an
    H100: 1 of 3072 outputs 4% off under rowwise scaling); a wrong scale or layout moves
    every element."""
    generator = torch.Generator().manual_seed(0)
    layer = kind(64, 96, group=None, fp8=recipe).to("cuda", torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64, generator=generator))
        layer.bias.copy_(torch.randn(96, generator=generator))
    x = (torch.randn(16, 2, 64, generator=generator)
         * torch.logspace(-2, 1, 16).view(16, 1, 1)).to("cuda", torch.bfloat16).requires_grad_()
    g = (torch.randn(16, 2, 96, generator=generator) * 1e-3).to("cuda", torch.bfloat16)
    y = layer(x)
    y.backward(g)
    expected = reference(x.detach().cpu(), layer.weight.detach().cpu(),
                         layer.bias.detach().cpu(), g.cpu(), recipe)
    for name, actual, want in zip(("y", "dx", "dw", "db"),
                                  (y, x.grad, layer.weight.grad, layer.bias.grad), expected):
        actual = actual.detach().cpu().double().reshape(want.shape)
        error = (actual - want).norm() / want.norm()
        far = ((actual - want).abs() > 1e-2 * want.abs() + 1e-2 * want.abs().max()).double()
        assert error < 1e-2 and far.mean() < 1e-2, (name, error.item(), far.mean().item())


@NEEDS_FP8_GPU
@pytest.mark.slow
@pytest.mark.parametrize("dim", [None, 0, 1])
def test_compiled_quantization_equals_the_eager_one_on_the_gpu(dim):
    """fp8._kernel's compiled amax and cast against the same functions run eagerly: the
    same scales, and FP8 codes equal but for a rare one-step tie (division rounding); the
    compiled cast-transpose's two copies hold the same codes."""
    t = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) \
        * torch.logspace(-3, 2, 512, device="cuda")
    for dtype in (E4M3, E5M2):
        amax = fp8._amax(t, dim)
        data, scale = fp8._scale_and_cast(t, amax, dtype)
        fused, (both, both_t) = fp8.quantize(t, dtype, dim), fp8.quantize_both(t, dtype, dim)
        # The cast-transpose writes the same codes twice, the second copy row-major.
        assert both_t.data.is_contiguous()
        assert torch.equal(both_t.data.view(torch.uint8), both.data.t().view(torch.uint8))
        for q in (fused, both):
            assert torch.equal(q.scale, scale)
            codes = (q.data.view(torch.uint8).int() - data.view(torch.uint8).int()).abs()
            assert codes.max() <= 1 and (codes > 0).float().mean() < 1e-3
