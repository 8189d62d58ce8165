"""The tensor-parallel GPT against the single-process model (docs/design.md §3).

Each rank builds its TP shard and, in the same process, the unsharded TP=1 model from the
same seed, and both see the same tokens: logits, loss, every gradient (TP shards gathered)
and 10 optimizer steps of losses must agree. The vocabulary (101) is divisible by neither
TP size, so the two models are padded differently; padding is masked out of the softmax.
"""

import dataclasses

import pytest
import torch

from megalite.config import OptimizerConfig
from megalite.spawn import run_distributed
from megalite.validation import pad_vocab_size
from megalite.model.gpt import GPTModel
from megalite.optimizer.optimizer import Optimizer
from megalite.parallel_state import ParallelState, RankGrid
from megalite.tensor_parallel.layers import allreduce_sequence_parallel_grads
from megalite.train_step import StepRunner

from tests.helpers import LLAMA_STYLE, gather_tensor_parallel, step_config, tiny_gpt_config

pytestmark = pytest.mark.slow  # every test here launches processes

VOCAB = 101
BASE = tiny_gpt_config(hidden_size=64, ffn_hidden_size=128, num_attention_heads=8, seq_length=16,
                       padded_vocab_size=pad_vocab_size(VOCAB, 8, 1), vocab_size=VOCAB)
CASES = {
    "gpt2-style": {},
    "gpt2-style, sequence parallel": dict(sequence_parallel=True),
    # --qk-layernorm: its weights are replicated over TP but each rank normalises its own
    # heads, so their gradients are partial sums, with SP and without.
    "llama-style (GQA, SwiGLU, RMSNorm, RoPE, untied, no bias, QK-norm), sequence parallel":
        dict(LLAMA_STYLE, num_query_groups=4, sequence_parallel=True, qk_layernorm=True),
    "llama-style, QK-norm": dict(num_query_groups=4, swiglu=True, normalization="RMSNorm",
                                 position_embedding_type="rope", add_bias_linear=False,
                                 qk_layernorm=True),
}


def compare_case(case: dict, state: ParallelState) -> list[str]:
    """Differences between the TP model and the reference, as readable strings."""
    tp, group = state.tp_size, state.tp_group
    reference_config = dataclasses.replace(BASE, **{**case, "sequence_parallel": False})
    tp_config = dataclasses.replace(BASE, **case, padded_vocab_size=pad_vocab_size(VOCAB, 8, tp))
    reference = GPTModel(reference_config, seed=11)
    model = GPTModel(tp_config, seed=11, tp_group=group)
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (3, 16))
    labels = torch.randint(0, VOCAB, (3, 16))
    problems = []

    def check(what, actual, expected, rtol=1e-5, atol=1e-6):
        if not torch.allclose(actual, expected, rtol=rtol, atol=atol):
            problems.append(f"{what}: max diff {(actual - expected).abs().max().item():.3g}")

    check("logits", model(tokens)[..., :VOCAB], reference(tokens)[..., :VOCAB])
    loss, ref_loss = model(tokens, labels).mean(), reference(tokens, labels).mean()
    check("loss", loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    allreduce_sequence_parallel_grads(list(model.parameters()), group)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad, ref_grad = gather_tensor_parallel(param.grad, param, group), ref_params[name].grad
        rows = min(grad.shape[0], ref_grad.shape[0])  # the vocabulary paddings differ
        check(f"grad of {name}", grad[:rows], ref_grad[:rows])
    return problems + compare_training(reference_config, tp_config, state)


def compare_training(reference_config, tp_config, state: ParallelState) -> list[str]:
    """10 AdamW steps of 2 micro-batches each: the same per-step losses and grad norms."""
    opt_config = OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5)
    runs = []
    for config, run_state in ((reference_config, None), (tp_config, state)):
        tp_group = run_state.tp_group if run_state else None
        model = GPTModel(config, seed=5, tp_group=tp_group)
        optimizer = Optimizer(model, opt_config, tp_group=tp_group, model_parallel_group=tp_group)
        runner = StepRunner(torch.nn.ModuleList([model]), optimizer, step_config(config, 2, 2),
                            run_state or ParallelState.single_process(), torch.device("cpu"))
        generator = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(10):
            batches = [{"tokens": torch.randint(0, VOCAB, (2, 16), generator=generator),
                        "labels": torch.randint(0, VOCAB, (2, 16), generator=generator),
                        "loss_mask": torch.ones(2, 16)} for _ in range(2)]
            result = runner.train_step(batches)
            losses.append((result.loss, result.grad_norm))
        runs.append(losses)
    problems = []
    for step, ((ref_loss, ref_norm), (loss, norm)) in enumerate(zip(*runs), start=1):
        if abs(loss - ref_loss) > 1e-5 * abs(ref_loss) or abs(norm - ref_norm) > 1e-4 * ref_norm:
            problems.append(f"step {step}: loss {loss} vs {ref_loss}, grad norm {norm} vs "
                            f"{ref_norm}")
    return problems


def tp_equivalence(rank, world_size):
    torch.set_num_threads(1)
    state = ParallelState(RankGrid(world_size, world_size, 1), rank)
    return {name: compare_case(case, state) for name, case in CASES.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_gpt_equals_single_process(tp):
    results = run_distributed(tp, tp_equivalence, timeout=300)
    failures = {f"rank {rank}, {case}": problems for rank, result in enumerate(results)
                for case, problems in result.items() if problems}
    assert not failures, failures
