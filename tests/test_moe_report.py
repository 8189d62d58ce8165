"""What a MoE run reports: FLOPs counting active parameters as Megatron does, the auxiliary
losses (divided by their coefficients) and the expert load on the log line, read back by
its parser."""

import dataclasses

import torch

from megalite.config import Config, DistributedConfig, LoggingConfig, ParallelConfig, \
    PrecisionConfig, TrainingConfig
from megalite.model.gpt import build_model_chunks
from megalite.monitoring.moe_metrics import moe_report
from megalite.training_log import log_line, num_floating_point_operations, parse_log_line

from tests.helpers import LLAMA_STYLE, tiny_gpt_config

MOE = dict(num_experts=8, moe_ffn_hidden_size=16, moe_router_topk=2,
           moe_layer_pattern=(True, False), moe_shared_expert_intermediate_size=24)


def test_flops_count_active_parameters():
    """A MoE layer costs what a dense layer of width F x k + S costs (Megatron's count);
    the dense layer of the pattern keeps ffn_hidden_size."""
    moe = tiny_gpt_config(**LLAMA_STYLE, **MOE)
    as_dense = dataclasses.replace(moe, num_experts=None, moe_layer_pattern=None,
                                   ffn_hidden_size=(16 * 2 + 24 + 64) / 2)
    assert num_floating_point_operations(moe, 4) == num_floating_point_operations(as_dense, 4)


def test_report_averages_losses_over_microbatches_and_layers():
    model = tiny_gpt_config(**LLAMA_STYLE, **{**MOE, "moe_layer_pattern": (True, True)},
                            moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.25)
    config = Config(model=model, parallel=ParallelConfig(),
                    training=TrainingConfig(micro_batch_size=2, global_batch_size=4,
                                            num_microbatches=2),
                    precision=PrecisionConfig(), logging=LoggingConfig(),
                    distributed=DistributedConfig())
    chunks = build_model_chunks(model, seed=3)
    expected = {"load_balancing_loss": 0.0, "z_loss": 0.0}
    hooks = []
    for layer in (chunks[0].decoder.layers["0"].mlp, chunks[0].decoder.layers["1"].mlp):
        def capture(module, args, _):
            losses = module.router(args[0].reshape(-1, 32), num_sequences=2).losses
            expected["load_balancing_loss"] += losses["load_balancing_loss"].item() / 0.5
            expected["z_loss"] += losses["z_loss"].item() / 0.25
        hooks.append(layer.register_forward_hook(capture))
    for seed in (0, 1):  # two micro-batches of one step
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
        chunks[0](tokens, tokens).sum().backward()
    fields, scalars = moe_report(chunks, config, tp_size=1, iterations=1,
                                 device=torch.device("cpu"))
    for name, total in expected.items():   # 2 layers x 2 micro-batches
        assert abs(fields["moe_losses"][name] - total / 4) < 1e-6 * total
        assert scalars[name] == fields["moe_losses"][name]
    assert fields["expert_load"] >= 1.0
    assert chunks[0].decoder.layers["0"].mlp.metrics == {}   # the sums restart


def test_log_line_carries_moe_fields():
    fields = dict(iteration=3, train_iters=9, consumed_samples=12, elapsed_ms=5.0,
                  tflops_per_gpu=None, learning_rate=1e-3, global_batch_size=4, lm_loss=2.5,
                  loss_scale=1.0, grad_norm=0.5, skipped_iters=0, nan_iters=0,
                  tokens_per_second=10.0,
                  moe_losses={"load_balancing_loss": 1.25, "z_loss": 0.5}, expert_load=1.5)
    line = log_line(**fields)
    assert " lm loss: 2.500000E+00 | load_balancing_loss: 1.250000E+00 | z_loss: " in line
    parsed = parse_log_line(line)
    assert {k: parsed[k] for k in fields} == fields
