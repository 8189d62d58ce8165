"""Optimizer pieces: weight-decay groups, clipping vs torch's, fp16 loss scaling rules, the
host step of --optimizer-cpu-offload vs torch's fused AdamW, where the forward waits for
ZeRO-1's overlapped parameter all-gathers."""

import copy
import dataclasses
import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

from megalite.config import OptimizerConfig
from megalite.errors import NumericalError
from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import GPTModel
from megalite.optimizer.grad_scaler import DynamicGradScaler
from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer
from megalite.optimizer.optimizer import Optimizer, no_weight_decay
from megalite.parallel_state import ParallelState
from megalite.train_step import StepRunner

from tests.helpers import step_config, tiny_gpt_config

# 128 vocabulary rows, sequence 16, hidden 64: the tokens and shapes below.
CONFIG = tiny_gpt_config(hidden_size=64, ffn_hidden_size=256, kv_channels=16, seq_length=16,
                         padded_vocab_size=128)


def test_no_weight_decay_on_biases_and_norms():
    model = GPTModel(CONFIG, seed=1)
    decay, no_decay = Optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.1)).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith("weight") and p.ndim == 2 for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} == {
        n for n, p in model.named_parameters() if n.endswith(".bias") or "layernorm" in n}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


def test_clipping_matches_torch():
    torch.manual_seed(0)
    a, b = GPTModel(CONFIG, 1), GPTModel(CONFIG, 1)
    tokens = torch.randint(0, 128, (2, 16))
    for m in (a, b):
        m(tokens, tokens).sum().backward()
    opt = Optimizer(a, OptimizerConfig(lr=1e-3, clip_grad=0.5))
    _, norm = opt.step()
    ref_norm = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    assert norm == pytest.approx(ref_norm.item(), rel=1e-6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        # `a`'s grads were clipped in place before its AdamW step; compare the grads.
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-8)


def test_dynamic_scaler_hysteresis_backoff_and_growth():
    s = DynamicGradScaler(initial_scale=1024, min_scale=1, window=3, hysteresis=2)
    s.update(found_inf=True)
    assert s.scale == 1024  # first overflow absorbed by hysteresis
    s.update(found_inf=True)
    assert s.scale == 512
    s.update(found_inf=True)
    assert s.scale == 256  # hysteresis is only restored by a growth
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 512
    s.update(found_inf=True)
    assert s.scale == 512  # hysteresis restored
    tiny = DynamicGradScaler(initial_scale=2, min_scale=1, window=10, hysteresis=1)
    for _ in range(3):
        tiny.update(found_inf=True)
    assert tiny.scale == 1


def test_overflow_skips_the_step_and_backs_off():
    model = GPTModel(CONFIG, seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = DynamicGradScaler(initial_scale=2.0 ** 16, min_scale=1, window=1000, hysteresis=1)
    opt = Optimizer(model, OptimizerConfig(lr=1e-2), scaler)
    tokens = torch.randint(0, 128, (2, 16))
    opt.scale_loss(model(tokens, tokens).mean()).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    updated, norm = opt.step()
    assert not updated and norm is None and scaler.scale == 2.0 ** 15
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    opt.scale_loss(model(tokens, tokens).mean()).backward()
    updated, norm = opt.step()
    assert updated and norm > 0
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_unscaled_grads_equal_fp32_grads():
    """With a finite scale the step sees the true gradient: same update as no scaling."""
    tokens = torch.randint(0, 128, (2, 16))
    results = []
    for scaler in (None, DynamicGradScaler(2.0 ** 10, 1, 1000, 2)):
        model = GPTModel(CONFIG, seed=1)
        opt = Optimizer(model, OptimizerConfig(lr=1e-2, clip_grad=0.0), scaler)
        opt.scale_loss(model(tokens, tokens).mean()).backward()
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_nan_gradient_with_a_finite_loss_stops_before_the_update():
    """--check-for-nan-in-loss-and-grad reads the gradients through the grad norm: a NaN
    in one gradient, the loss finite, still stops the step and names the rank."""
    model = GPTModel(CONFIG, seed=1)
    runner = StepRunner(torch.nn.ModuleList([model]), Optimizer(model, OptimizerConfig(lr=1e-3)),
                        step_config(CONFIG, 2, check_for_nan=True),
                        ParallelState.single_process(), torch.device("cpu"))
    weight = model.decoder.final_layernorm.weight
    weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("nan")))
    tokens = torch.randint(0, 128, (2, 17))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NumericalError, match=r"a gradient is NaN or infinite on rank\(s\) "
                                             r"\[0\]; stopped before the optimizer step"):
        runner.train_step([{"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                            "loss_mask": torch.ones(2, 16)}])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_offloaded_step_is_torchs_fused_adamw():
    """ZeRO-1's --optimizer-cpu-offload on one rank, four buckets: the host step is torch's
    fused AdamW (one pass per tensor; foreach rounds differently), and the updated main
    parameters reach the model (one copy per bucket), bit for bit those of
    torch.optim.AdamW(fused=True) on a copy of the model."""
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0)
    model = GPTModel(CONFIG, seed=1)
    reference = copy.deepcopy(model)
    named = list(reference.named_parameters())
    adam = torch.optim.AdamW(
        [{"params": [p for n, p in named if not no_weight_decay(n, p)]},
         {"params": [p for n, p in named if no_weight_decay(n, p)], "weight_decay": 0.0}],
        lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
        weight_decay=config.weight_decay, fused=True)
    grad_buffer = GradBuffer(list(model.parameters()), None, 40000, shard=True)
    assert len(grad_buffer.buckets) == 4
    offloaded = MixedPrecisionOptimizer(model, config, None, None, None, grad_buffer,
                                        cpu_offload=True)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        grad_buffer.start_step(1)
        model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        grad_buffer.finish()
        offloaded.step()
        adam.zero_grad()
        reference(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        adam.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), (name, (p - q).abs().max().item())


class RecordedGather:
    """An all-gather in flight (torch's Work) that logs when the forward waits for it."""

    def __init__(self, bucket: int, log: list):
        self.bucket, self.log = bucket, log

    def wait(self):
        self.log.append(("wait", self.bucket))


def test_overlapped_gathers_are_waited_for_before_each_compiled_layer(monkeypatch):
    """--overlap-param-gather with compiled layers: each layer waits for the all-gathers of
    its own buckets, all of them and no others, just before it runs; the wait stays outside
    its compiled forward, which dynamo captures once for every layer, whole (issue 39: waits
    hooked inside a layer recompiled it per layer). One parameter per bucket."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    model = GPTModel(dataclasses.replace(CONFIG, num_layers=4, compile_layers=True), seed=1)
    grad_buffer = GradBuffer(list(model.parameters()), None, 1, shard=True)
    optimizer = MixedPrecisionOptimizer(model, OptimizerConfig(lr=1e-3), None, None, None,
                                        grad_buffer, overlap_param_gather=True)
    log = []
    optimizer._gathers = [RecordedGather(i, log) for i in range(len(grad_buffer.buckets))]
    bucket_of = {id(p): i for i, b in enumerate(grad_buffer.buckets) for p in b.params}
    layers = list(model.decoder.layers.values())
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_, i=i: log.append(("ran", i)))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens)
    ran = [log.index(("ran", i)) for i in range(len(layers))]
    for i, layer in enumerate(layers):
        waited = {b for kind, b in log[ran[i - 1] + 1 if i else 0:ran[i]] if kind == "wait"}
        own = {bucket_of[id(p)] for p in layer.parameters()}
        before = {bucket_of[id(p)] for p in model.embedding.parameters()} if i == 0 else set()
        assert waited == own | before, f"layer {i}"
    compiles = get_compilation_metrics()
    assert [c.recompile_reason for c in compiles if c.recompile_reason] == []
    assert dict(counters["graph_break"]) == {}
    assert any(c.co_name == "forward" and c.graph_op_count for c in compiles)
    torch._dynamo.reset()
