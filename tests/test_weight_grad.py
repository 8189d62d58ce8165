"""The split backward (issue 16): B then W gives, bit for bit, the input and weight
gradients of one backward, for every linear layer the model uses (column- and
row-parallel, with and without bias, the tied output layer) and for the whole GPT (with
full recompute too); W alone reaches the weights and the gradient buffer's hooks. TP and
SP run in tests/distributed/test_weight_grad_tp.py."""

import pytest
import torch
import torch.nn.functional as F

from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import GPTModel
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.weight_grad import LinearStep, WeightGradStore, linear

from tests.helpers import LLAMA_STYLE, tiny_gpt_config


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def layers():
    column = ColumnParallelLinear(8, 12, group=None)
    row = RowParallelLinear(12, 8, group=None)
    no_bias = ColumnParallelLinear(8, 6, group=None, bias=False)
    for i, p in enumerate([*column.parameters(), *row.parameters(), *no_bias.parameters()]):
        p.data.copy_(randn(*p.shape, seed=i))
    return {"column": column, "row": row, "column without bias": no_bias}


def grads(module, x, grad_out, split):
    """(input grad, {param: grad}) of one backward, or of B then W when `split`, with
    nothing but the input gradient and biases known between the two."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = module(x)
    store = WeightGradStore()
    if split:
        with module.linear_step.defer_weight_grads(store):
            y.backward(grad_out)
        assert module.weight.grad is None, "B computed a weight gradient"
        assert store.pending
        store.run()
        assert not store.pending
    else:
        y.backward(grad_out)
    return x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("kind", ["column", "row", "column without bias"])
def test_b_then_w_equals_one_backward_bit_for_bit(kind):
    module = layers()[kind]
    x = randn(5, 3, module.weight.shape[1], seed=10)
    grad_out = randn(5, 3, module.weight.shape[0], seed=11)
    dx, dparams = grads(module, x, grad_out, split=False)
    dx_split, dparams_split = grads(module, x, grad_out, split=True)
    assert torch.equal(dx, dx_split)
    assert dparams.keys() == dparams_split.keys()
    for name in dparams:
        assert torch.equal(dparams[name], dparams_split[name]), name
    # And both are the linear layer's gradients (independent reference: torch's F.linear).
    x_ref = x.clone().requires_grad_()
    weight = module.weight.detach().clone().requires_grad_()
    F.linear(x_ref, weight).backward(grad_out)
    torch.testing.assert_close(dx, x_ref.grad)
    torch.testing.assert_close(dparams["weight"], weight.grad)


def test_w_accumulates_into_existing_grads():
    # Two micro-batches: the second's W adds to the first's gradient as autograd would.
    module = layers()["column"]
    x, g = randn(4, 2, 8, seed=1), randn(4, 2, 12, seed=2)
    module.zero_grad(set_to_none=True)
    for _ in range(2):
        module(x).backward(g)
    expected = module.weight.grad.clone()
    module.zero_grad(set_to_none=True)
    for _ in range(2):
        store = WeightGradStore()
        with module.linear_step.defer_weight_grads(store):
            module(x).backward(g)
        store.run()
    assert torch.equal(module.weight.grad, expected)


def test_plain_linear_under_autocast_keeps_the_dtype_of_f_linear():
    x = randn(4, 8, seed=1)
    weight = randn(6, 8, seed=2).bfloat16().requires_grad_()
    step = LinearStep()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ref = linear(x, weight, None, step), F.linear(x, weight)
    assert y.dtype == ref.dtype == torch.bfloat16 and torch.equal(y, ref)
    store = WeightGradStore()
    with step.defer_weight_grads(store):
        y.float().sum().backward()
    store.run()
    assert weight.grad.dtype == torch.bfloat16


def test_grad_buffer_sees_the_w_pass():
    """Readiness for overlapped reduction: a bucket is complete after the last micro-batch's
    W, not after its B (the buffer counts accumulations per parameter)."""
    module = layers()["column"]
    x, g = randn(4, 2, 8, seed=1), randn(4, 2, 12, seed=2)
    expected = grads(module, x, g, split=False)[1]["weight"] * 2
    module.bias.requires_grad_(False)  # the weight alone in the buffer: it arrives in W
    buffer = GradBuffer([module.weight], None, 10**6, overlap=True)
    buffer.linear_step = module.linear_step  # as StepRunner gives it its own
    buffer.start_step(2)
    stores = []
    for _ in range(2):
        stores.append(WeightGradStore())
        with module.linear_step.defer_weight_grads(stores[-1]):
            module(x).backward(g)
    assert buffer.launched_during_backward == 0
    assert not module.weight.main_grad.any()
    for store in stores:
        store.run()
    assert buffer.launched_during_backward == 1
    buffer.finish()
    torch.testing.assert_close(module.weight.main_grad, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("overrides", [
    {},                                        # GPT-2: biases, tied output (plain linear)
    LLAMA_STYLE,                               # untied output layer (column parallel)
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
], ids=["gpt2-tied", "llama-untied", "full-recompute"])
def test_whole_model_b_then_w_equals_one_backward(overrides):
    config = tiny_gpt_config(**overrides)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def run(split):
        model = GPTModel(config, seed=5)
        step = LinearStep()
        step.install(model)
        store = WeightGradStore()
        loss = model(tokens, labels).sum()
        with step.defer_weight_grads(store) if split else torch.enable_grad():
            loss.backward()
        if split:
            linears = {n for n, p in model.named_parameters() if p.grad is None}
            store.run()
            return {n: p.grad for n, p in model.named_parameters()}, linears
        return {n: p.grad for n, p in model.named_parameters()}, set()

    one, _ = run(False)
    split, deferred = run(True)
    # Every linear weight waited for W; the rest (norms, biases, embeddings) got theirs in B.
    expected = {n for n in one if n.endswith(("linear_qkv.weight", "linear_proj.weight",
                                              "linear_fc1.weight", "linear_fc2.weight",
                                              "output_layer.weight"))}
    if not config.untie_embeddings_and_output_weights:
        assert "embedding.word_embeddings.weight" not in deferred  # its lookup grad came in B
    assert deferred == expected
    for name in one:
        assert torch.equal(one[name], split[name]), name


def test_w_pass_is_one_engine_call_holding_one_weight_gradient_at_a_time(monkeypatch):
    """The W pass enters the autograd engine once, not once per weight, and the engine
    accumulates each dA before it computes the next (never all of a stage's at once)."""
    model = GPTModel(tiny_gpt_config(), seed=5)
    step = LinearStep()
    step.install(model)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    store = WeightGradStore()
    with step.defer_weight_grads(store):
        model(tokens, tokens).sum().backward()
    deferred = len(store.pending)
    assert deferred > 4
    events, engine_calls = [], []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: events.append("accumulated"))
    store.pending = [(weight, lambda *args, compute=compute: events.append("computed")
                      or compute(*args), tensors) for weight, compute, tensors in store.pending]
    for name in ("backward", "grad"):
        def counted(*args, entry=getattr(torch.autograd, name), name=name, **kwargs):
            engine_calls.append(name)
            return entry(*args, **kwargs)
        monkeypatch.setattr(torch.autograd, name, counted)
    store.run()
    assert len(engine_calls) == 1, engine_calls
    assert events == ["computed", "accumulated"] * deferred


def test_one_store_at_a_time():
    step = LinearStep()
    with step.defer_weight_grads(WeightGradStore()):
        with pytest.raises(RuntimeError, match="already active"):
            with step.defer_weight_grads(WeightGradStore()):
                pass


def test_two_models_keep_their_own_w_stores():
    """Two models in one process, each with its own LinearStep: the second's backward, run
    while the first's B pass defers (from a hook in that backward), computes its weight
    gradient at once, and the first's store holds the first's weight alone. With one
    module-level store the second's gradient went into the first's W pass."""
    first, second = layers()["column"], layers()["row"]
    x, g = randn(4, 2, 12, seed=3), randn(4, 2, 8, seed=4)
    _, alone = grads(second, x, g, split=False)
    second.zero_grad(set_to_none=True)
    y = first(randn(4, 2, 8, seed=1))

    def second_backward(_):
        with torch.enable_grad():  # a backward's hooks run without
            second(x).backward(g)
    y.register_hook(second_backward)
    store = WeightGradStore()
    with first.linear_step.defer_weight_grads(store):
        y.backward(randn(4, 2, 12, seed=2))
    assert second.weight.grad is not None and torch.equal(second.weight.grad, alone["weight"])
    assert store.weights == {id(first.weight)}


@pytest.mark.parametrize("kind", ["column", "row", "column without bias"])
def test_unsplit_linear_equals_the_splittable_one_bit_for_bit(kind):
    """Schedules without W passes run the layers inside LinearStep.unsplit (torch's own
    linear node, no custom function): the same output and gradients, bit for bit."""
    module = layers()[kind]
    x = randn(5, 3, module.weight.shape[1], seed=10)
    grad_out = randn(5, 3, module.weight.shape[0], seed=11)
    dx, dparams = grads(module, x, grad_out, split=False)
    with module.linear_step.unsplit():
        y = module(x)
        assert y.grad_fn.name() != "_LinearBackward"
        dx_unsplit, dparams_unsplit = grads(module, x, grad_out, split=False)
    assert torch.equal(y, module(x))
    assert torch.equal(dx, dx_unsplit)
    for name in dparams:
        assert torch.equal(dparams[name], dparams_unsplit[name]), name


def test_unsplit_model_equals_the_splittable_one_bit_for_bit():
    config = tiny_gpt_config()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def run(split):
        model = GPTModel(config, seed=5)
        step = LinearStep()
        step.install(model)
        with torch.enable_grad() if split else step.unsplit():
            model(tokens, labels).sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}

    splittable, unsplit = run(True), run(False)
    for name in splittable:
        assert torch.equal(splittable[name], unsplit[name]), name
