"""The model's fused and memory-lean kernels (issue 13) against plain-torch references:
norms, the vocab-parallel cross-entropy, the fused SwiGLU projection and its stacked
tensor-parallel layout (init, shards, checkpoints), the RoPE table, attention's RNG at
TP 1 and CP 1, and --compile-layers."""

import contextlib
import functools
import math
import os

import pytest
import torch
import torch.nn.functional as F

from megalite.arguments import parse_args
from megalite.checkpointing.loading import SavedCheckpoint
from megalite.checkpointing.saving import model_file, optim_file
from megalite.checkpointing.storage import save_tensor_file
from megalite.model import norms
from megalite.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.model.init import initial_value
from megalite.model.rotary import apply_rotary, rotary_frequencies, rotary_table
from megalite.tensor_parallel.cross_entropy import (vocab_parallel_cross_entropy,
                                                    whole_vocab_cross_entropy)
from megalite.tensor_parallel.params import (local_shard, mark_stacked, mark_tensor_parallel,
                                             tp_shard)
from megalite.validation import validate_args

from tests.helpers import flags_with, tiny_gpt_config

H, F_, EPS = 32, 48, 1e-5
FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


def config(**kw) -> GPTConfig:
    base = dict(hidden_size=H, ffn_hidden_size=F_, num_query_groups=2, seq_length=16,
                swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                add_bias_linear=False)
    return tiny_gpt_config(**{**base, **kw})


# --------------------------------------------------------------------------------- norms

def reference_rms_norm(x, weight):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def reference_layer_norm(x, weight, bias):
    x = x.double()
    mean, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
    return (x - mean) / torch.sqrt(var + EPS) * weight.double() + bias.double()


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_norms_equal_the_formula_in_fp32(kind):
    norm = norms.build_norm(config(normalization=kind, norm_epsilon=EPS))
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    x = 3 * torch.randn(5, 2, H) + 1
    y = norm(x)
    ref = (reference_rms_norm(x, norm.weight) if kind == "RMSNorm"
           else reference_layer_norm(x, norm.weight, norm.bias))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_norm_output_has_the_input_dtype_under_autocast(kind):
    norm = norms.build_norm(config(normalization=kind)).to(torch.bfloat16)
    x = torch.randn(4, 2, H, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(x).dtype == torch.bfloat16


def test_layer_norm_casts_an_fp32_result_back(monkeypatch):
    """CUDA autocast runs layer_norm in fp32 and returns fp32 (CPU autocast does not):
    simulate that kernel and check the module hands its input's dtype on."""
    real = F.layer_norm

    def cuda_autocast_layer_norm(x, *args, **kwargs):
        return real(x.float(), *(a.float() if torch.is_tensor(a) else a for a in args),
                    **kwargs)
    monkeypatch.setattr(F, "layer_norm", cuda_autocast_layer_norm)
    norm = norms.LayerNorm(H).to(torch.bfloat16)
    x = torch.randn(4, 2, H, dtype=torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, real(x.float(), (H,)).to(torch.bfloat16))


# ------------------------------------------------------------------------- cross-entropy

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_equals_torch_and_saves_one_logits_buffer(dtype):
    logits = (20 * torch.randn(6, 3, 40)).to(dtype)  # large: exercises the max shift
    target = torch.randint(0, 40, (6, 3))
    grad_loss = torch.randn(6, 3)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.float().view(-1, 40), target.view(-1), reduction="none")
    ref.view(6, 3).backward(grad_loss)

    ours = logits.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        buffer = ours.float()  # as the model passes them; fp32 logits are this very tensor
        loss = vocab_parallel_cross_entropy(buffer, target, None)
    loss.backward(grad_loss)
    torch.testing.assert_close(loss, ref.view(6, 3), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ours.grad, full.grad)
    # Of the [6, 3, 40] tensors it keeps one, the softmax, computed in the logits' buffer.
    big = [t for t in saved if t.numel() == logits.numel()]
    assert len(big) == 1 and big[0].data_ptr() == buffer.data_ptr()


# ------------------------------------------------------------------- fused SwiGLU, stacked

def test_tp_shard_of_a_stacked_parameter_takes_its_block_of_each_part():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    param = torch.nn.Parameter(torch.empty(8, 3))  # a TP 2 rank's [gate block; up block]
    mark_tensor_parallel(param, 0)
    mark_stacked(param, 2)
    full = torch.cat([gate, up])
    for rank in range(2):
        expected = torch.cat([gate[4 * rank:4 * rank + 4], up[4 * rank:4 * rank + 4]])
        assert torch.equal(tp_shard(full, param, "x.weight", rank, 2), expected)


def test_fused_fc1_starts_from_the_separate_gate_and_up_draws():
    c = config()
    fc1 = GPTModel(c, seed=5).decoder.layers["1"].mlp.linear_fc1.weight
    gate = initial_value(FC1.replace("linear_fc1", "linear_fc1_gate"), (F_, H), c, 5)
    up = initial_value(FC1, (F_, H), c, 5)
    assert fc1.shape == (2 * F_, H)
    assert torch.equal(fc1, torch.cat([gate, up]))


def test_fused_mlp_equals_swiglu_formula():
    mlp = GPTModel(config(), seed=1).decoder.layers["0"].mlp
    gate, up = mlp.linear_fc1.weight.chunk(2)
    x = torch.randn(5, 2, H)
    ref = (F.silu(x @ gate.t()) * (x @ up.t())) @ mlp.linear_fc2.weight.t()
    torch.testing.assert_close(mlp(x), ref)


def _write_tp2_checkpoint(directory, full: dict, legacy: bool):
    """TP 2 model and optimizer files as saving.py writes them; `legacy`: the format
    before the fusion, gate and up as two column-parallel parameters."""
    for t in range(2):
        if legacy:
            gate, up = full[FC1].chunk(2)
            params = {FC1.replace("fc1", "fc1_gate"): gate.chunk(2)[t], FC1: up.chunk(2)[t]}
            layout = {"partition_dims": dict.fromkeys(params, 0)}
        else:
            gate, up = full[FC1].chunk(2)
            params = {FC1: torch.cat([gate.chunk(2)[t], up.chunk(2)[t]])}
            layout = {"partition_dims": {FC1: 0}, "partition_strides": {FC1: 2}}
        save_tensor_file({"params": params, **layout}, directory / model_file(t, 0))
        segments = {n: {"range": torch.tensor([0, p.numel()]), "main": p.reshape(-1),
                        "exp_avg": 2 * p.reshape(-1), "exp_avg_sq": 3 * p.reshape(-1)}
                    for n, p in params.items()}
        save_tensor_file({"step": 4, "segments": segments}, directory / optim_file(t, 0, 0))
    return {"layout": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                       "data_parallel_size": 1, "use_distributed_optimizer": False}}


@pytest.mark.parametrize("legacy", [False, True])
def test_checkpoints_reassemble_the_fused_fc1_and_reshard_it(tmp_path, legacy):
    full = {FC1: torch.randn(2 * F_, H)}
    saved = SavedCheckpoint(tmp_path, _write_tp2_checkpoint(tmp_path, full, legacy))
    assert saved.names == [FC1]
    assert torch.equal(saved.param(FC1), full[FC1])
    assert torch.equal(saved.optimizer_tensor(FC1, "exp_avg"), 2 * full[FC1])
    # Loading at TP 4: rank 3 holds the last quarter of gate and the last quarter of up.
    param = GPTModel(config(), seed=0).decoder.layers["1"].mlp.linear_fc1.weight
    param = torch.nn.Parameter(param.detach()[:2 * F_ // 4])
    mark_tensor_parallel(param, 0)
    mark_stacked(param, 2)
    gate, up = full[FC1].chunk(2)
    q = F_ // 4
    expected = torch.cat([gate[3 * q:], up[3 * q:]])
    assert torch.equal(local_shard(saved.param(FC1), param, FC1, 3, 4), expected)


# ---------------------------------------------------------------------------------- RoPE

def test_rotary_table_rows_rotate_positions_from_an_offset():
    """A KV-cache step at positions 7..9 reads rows 7..9 of the model's one table."""
    s, d, base, offset = 3, 8, 10000, 7
    x = torch.randn(s, 2, 3, d)
    y = apply_rotary(x, rotary_table(rotary_frequencies(16, d, base))[offset:offset + s])
    for m in range(s):
        for i in range(d // 2):
            theta = (offset + m) * base ** (-2 * i / d)
            a, b = x[m, ..., i], x[m, ..., i + d // 2]
            torch.testing.assert_close(y[m, ..., i], a * math.cos(theta) - b * math.sin(theta))


# --------------------------------------------------------- RNG fork at TP 1 and CP 1

class CountingTracker:
    def __init__(self):
        self.forks = 0

    @contextlib.contextmanager
    def fork(self, name=None):
        self.forks += 1
        yield


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_attention_at_tp_1_and_cp_1_never_forks_the_rng(dropout):
    """With one TP and one CP rank no mask must differ from another rank's: the default
    stream serves, and a compiled layer has no generator swap to break its graph at. (At TP
    2 it forks to draw dropout only: tests/distributed/test_tp_layers.py.)"""
    tracker = CountingTracker()
    model = GPTModel(config(attention_dropout=dropout), seed=0, rng_tracker=tracker)
    attention = model.decoder.layers["0"].self_attention
    attention(torch.randn(16, 2, H), model.rope_table(torch.device("cpu")))
    assert tracker.forks == 0


# ------------------------------------------------------------------------ compile-layers

# Inductor compiles a layer's forward and backward in about 2.5 minutes on a 2-core CI
# machine: the default test uses torch.compile's aot_eager backend (the same graph
# capture and autograd, eager kernels); MEGALITE_TEST_INDUCTOR=1 runs inductor itself.
COMPILE_BACKEND = "inductor" if os.environ.get("MEGALITE_TEST_INDUCTOR") else "aot_eager"


def test_compiled_layers_equal_eager(monkeypatch):
    monkeypatch.setattr(torch, "compile",
                        functools.partial(torch.compile, backend=COMPILE_BACKEND))
    torch._dynamo.reset()
    compiled = GPTModel(config(compile_layers=True), seed=2)
    eager = GPTModel(config(), seed=2)
    assert all(layer._compiled_call_impl is not None
               for layer in compiled.decoder.layers.values())
    assert list(dict(compiled.named_parameters())) == list(dict(eager.named_parameters()))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for model in (compiled, eager):
        model(tokens, tokens).mean().backward()
    torch.testing.assert_close(compiled(tokens, tokens), eager(tokens, tokens))
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize("backend", ["aot_eager", "aot_eager_decomp_partition"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_loss_equals_the_eager_vocab_parallel_one(backend, dtype):
    """The loss a model with compiled layers runs (whole_vocab_cross_entropy, compiled;
    aot_eager_decomp_partition partitions forward and backward as inductor does) against
    torch's cross-entropy on the same logits, padding masked: losses and logit gradients."""
    torch._dynamo.reset()
    logits = (20 * torch.randn(6, 3, 40)).to(dtype)
    mask = torch.arange(40) >= 37  # the last 3 columns are vocabulary padding
    target = torch.randint(0, 37, (6, 3))
    grad_loss = torch.randn(6, 3)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.float()[..., :37].reshape(-1, 37), target.view(-1),
                          reduction="none").view(6, 3)
    ref.backward(grad_loss)
    ours = logits.clone().requires_grad_()
    loss = torch.compile(whole_vocab_cross_entropy, backend=backend)(ours, target, mask)
    loss.backward(grad_loss)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ours.grad[..., :37], full.grad[..., :37])
    assert torch.all(ours.grad[..., 37:] == 0)


def test_a_model_with_compiled_layers_compiles_its_loss():
    """With compiled layers (one process) the loss is compiled too, and with eager ones
    under --cross-entropy-loss-fusion; otherwise the loss is the eager vocab-parallel one."""
    assert GPTModel(config(compile_layers=True), seed=0)._compiled_loss is not None
    assert GPTModel(config(cross_entropy_loss_fusion=True), seed=0)._compiled_loss is not None
    assert GPTModel(config(), seed=0)._compiled_loss is None


@pytest.mark.parametrize("flags, world, device, compiled", [
    ([], 1, "cuda", True),  # the default on a GPU
    ([], 1, "cpu", False),  # ... and not on a CPU
    (["--no-compile-layers"], 1, "cuda", False),
    (["--compile-layers"], 1, "cpu", True),
    (["--compile-layers", "--no-compile-layers"], 1, "cuda", False),  # the last one given
    (["--tensor-model-parallel-size", "2"], 2, "cuda", False),
    (["--context-parallel-size", "2"], 2, "cuda", False),
    (["--num-experts", "4", "--disable-bias-linear"], 1, "cuda", False),
    (["--use-torch-fsdp2"], 1, "cuda", False),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"], 2, "cuda", False),
    (["--pipeline-model-parallel-size", "2"], 2, "cuda", True),
    (["--recompute-granularity", "selective"], 1, "cuda", False),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], 1, "cuda", True),
])
def test_layers_compile_by_default_on_a_gpu_where_they_have_run_there(flags, world, device,
                                                                      compiled):
    """--compile-layers / --no-compile-layers, and with neither the rule of
    config.compile_by_default as its docstring and --help state it."""
    config = validate_args(parse_args(flags_with(*flags)), world_size=world)
    assert config.layers_compiled(device) is compiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (inductor's Triton "
                    "kernels: the path --compile-layers takes by default on a GPU)")
@pytest.mark.slow  # inductor starts its compile workers (processes)
def test_compiled_layers_equal_eager_in_bf16_on_the_gpu():
    """The default path on a GPU (config.compile_by_default) against eager mode, both in
    bf16, each measured against the same model in fp32: compiled layers are as close to
    it as eager ones, within bf16 round-off (inductor fuses elementwise chains in fp32 and
    rounds once where eager rounds after each op, so neither is the other bit for bit)."""
    torch._dynamo.reset()
    shape = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 seq_length=64)
    tokens = torch.randint(0, 64, (4, 64), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    runs = {}
    for name, compiled, dtype in (("fp32", False, torch.float32), ("eager", False, torch.bfloat16),
                                  ("compiled", True, torch.bfloat16)):
        model = GPTModel(config(compile_layers=compiled, **shape), seed=2).to("cuda", dtype)
        loss = model(tokens, tokens).float().mean()
        loss.backward()
        runs[name] = (loss.item(), {n: p.grad.float() for n, p in model.named_parameters()})
    reference, grads = runs["fp32"]

    def error(name):
        loss, got = runs[name]
        return abs(loss - reference) / reference, {
            n: ((got[n] - g).norm() / g.norm()).item() for n, g in grads.items()}
    (eager_loss, eager), (compiled_loss, compiled) = error("eager"), error("compiled")
    assert compiled_loss <= 2 * eager_loss + 1e-3
    for n in grads:
        assert compiled[n] <= 2 * eager[n] + 2e-3, (n, compiled[n], eager[n])
