"""Multi-token prediction (DeepSeek-V3 §2.2; Megatron's MultiTokenPredictionBlock): D
sequential modules after the model, on its last pipeline stage. Module k (k = 1..D) takes the
previous depth's hidden state h^{k-1} (h^0: the model's output after its final norm, as
Megatron passes it) and the embedding of the token k ahead, and computes

    h^k = final_layernorm(TransformerLayer(eh_proj([enorm(emb); hnorm(h^{k-1})])))

whose logits, through the model's own output layer, predict the token k + 1 ahead.

The targets are shifted on the whole sample by the data loader (data/sampler.py
`add_mtp_targets`), before context parallelism cuts it into chunks, so no rank needs its
neighbour's tokens (Megatron rolls them over the CP group instead, roll_tensor). The token
embedded at depth k is the label rolled k - 1 places (labels hold the tokens one ahead).

The losses reach the gradient as Megatron's MTPLossAutoScaler adds them: not to the
reported lm loss but into backward, each depth's summed token losses weighted by
`loss_weights` (set per step by `set_mtp_loss_weights`: --mtp-loss-scaling-factor / D /
the global batch's loss tokens at that depth, times the fp16 loss scale), so the MTP term
is the token-weighted mean over the global batch at any layout, as the lm loss is.
"""

import torch
from torch import nn

from megalite.config import GPTConfig
from megalite.model.moe import AuxLossBackward, modules_of
from megalite.model.norms import build_norm
from megalite.model.transformer import TransformerLayer
from megalite.tensor_parallel.layers import ColumnParallelLinear
from megalite.tensor_parallel.mappings import scatter_to_sequence_parallel_region


class MultiTokenPredictionLayer(nn.Module):
    """One depth. Its transformer layer is of the model's last layer's kind (dense or MoE),
    as Megatron builds it from the decoder's last layer spec."""

    def __init__(self, config: GPTConfig, tp_group=None, rng_tracker=None, cp_group=None,
                 ep_group=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, config.sequence_parallel
        self.enorm = build_norm(config)
        self.hnorm = build_norm(config)
        self.eh_proj = ColumnParallelLinear(2 * config.hidden_size, config.hidden_size,
                                            group=tp_group, bias=False, gather_output=True,
                                            sequence_parallel=config.sequence_parallel)
        self.transformer_layer = TransformerLayer(config, tp_group, rng_tracker, cp_group,
                                                  layer_index=config.num_layers - 1,
                                                  ep_group=ep_group)
        self.final_layernorm = build_norm(config)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor,
                rope_table: torch.Tensor | None) -> torch.Tensor:
        """hidden, embedded [s, b, h] (this rank's sequence shard under SP) -> h^k."""
        # Megatron's order: the embedding first.
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        return self.final_layernorm(self.transformer_layer(x, rope_table))


class MultiTokenPrediction(nn.Module):
    """The D modules, `layers.{k-1}` for depth k (Megatron's parameter names), and the sums
    of their token losses over this step's micro-batches, for the log line."""

    def __init__(self, config: GPTConfig, tp_group=None, rng_tracker=None, cp_group=None,
                 ep_group=None):
        super().__init__()
        self.layers = nn.ModuleList(
            MultiTokenPredictionLayer(config, tp_group, rng_tracker, cp_group, ep_group)
            for _ in range(config.mtp_depths))
        self.loss_weights: torch.Tensor | None = None  # [D], set_mtp_loss_weights
        self.loss_sums: torch.Tensor | None = None  # [D], since take_mtp_loss_sums

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, targets, embed, rope_table,
                depth_losses) -> torch.Tensor:
        """The weighted sum over depths of each depth's summed token losses, the term
        the MTP adds to the loss. `hidden`: the model's final hidden states; `labels`
        [b, s]; `targets`: the loader's (mtp_labels, mtp_loss_mask), each [b, s, D];
        `embed(tokens)` the model's embedding, `depth_losses(h, labels)` per-token losses
        [b, s] of the model's output layer."""
        if self.loss_weights is None:
            raise RuntimeError("the MTP loss weights are unset: set_mtp_loss_weights before a "
                               "training forward (StepRunner.train_step does)")
        mtp_labels, mtp_mask = targets
        total, sums = 0.0, []
        for k, layer in enumerate(self.layers):
            tokens = labels if k == 0 else mtp_labels[..., k - 1]
            hidden = layer(hidden, embed(tokens), rope_table)
            summed = (depth_losses(hidden, mtp_labels[..., k]) * mtp_mask[..., k]).sum()
            sums.append(summed.detach())
            total = total + summed * self.loss_weights[k]
        sums = torch.stack(sums)
        self.loss_sums = sums if self.loss_sums is None else self.loss_sums + sums
        return total


def set_mtp_loss_weights(chunks, weights: torch.Tensor):
    """The gradient each depth's summed token losses get this step (module docstring)."""
    for block in modules_of(chunks, MultiTokenPrediction):
        block.loss_weights = weights


def take_mtp_loss_sums(chunks, depths: int, device: torch.device) -> torch.Tensor:
    """Each depth's summed token losses over the micro-batches since the last call ([D];
    zeros on a rank without the MTP modules), and restart the sums."""
    sums = torch.zeros(depths, device=device)
    for block in modules_of(chunks, MultiTokenPrediction):
        if block.loss_sums is not None:
            sums += block.loss_sums.to(device)
        block.loss_sums = None
    return sums


def attach_mtp_loss(losses: torch.Tensor, mtp_loss: torch.Tensor) -> torch.Tensor:
    """`losses` unchanged; backward gives `mtp_loss` the gradient 1 (its weights carry the
    scale), as if it had been added to the loss."""
    return AuxLossBackward.apply(losses, mtp_loss, 1.0)
