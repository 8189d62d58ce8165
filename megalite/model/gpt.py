"""The GPT decoder: embedding -> transformer layers -> final norm -> output layer -> loss.

Activations are sequence-first, [seq, batch, hidden], as in Megatron: sequence
parallelism then splits dim 0, which is contiguous.
"""

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.model.config import GPTConfig
from megalite.model.norms import build_norm
from megalite.model.rotary import rotary_frequencies
from megalite.model.transformer import TransformerLayer


class Embedding(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                    config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, seq] -> [seq, batch, hidden]."""
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.position_embeddings(positions)
        return self.dropout(x.transpose(0, 1))


class Decoder(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.final_layernorm = build_norm(config)

    def forward(self, x: torch.Tensor, rotary_angles: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, rotary_angles)
        return self.final_layernorm(x)


class GPTModel(nn.Module):
    def __init__(self, config: GPTConfig, seed: int):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.decoder = Decoder(config)
        self.output_layer = None
        if config.untie_embeddings_and_output_weights:
            self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        if config.position_embedding_type == "rope":
            rotary_dim = int(config.kv_channels * config.rotary_percent)
            self.register_buffer("rotary_angles", rotary_frequencies(
                config.seq_length, rotary_dim, config.rotary_base), persistent=False)
        else:
            self.rotary_angles = None
        initialize_parameters(self, config, seed)

    def output_weight(self) -> torch.Tensor:
        if self.output_layer is None:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq]. Returns per-token losses [batch, seq] (fp32) when labels
        are given, else logits [batch, seq, padded vocab]."""
        angles = None
        if self.rotary_angles is not None:
            angles = self.rotary_angles[: tokens.shape[1]]
        x = self.decoder(self.embedding(tokens), angles)
        logits = F.linear(x, self.output_weight())
        if labels is None:
            return logits.transpose(0, 1)
        # Softmax in fp32: in bf16 the log-sum-exp over a large vocabulary loses digits
        # the loss is measured in.
        s, b, v = logits.shape
        losses = F.cross_entropy(logits.float().view(s * b, v), labels.t().reshape(s * b),
                                 reduction="none")
        return losses.view(s, b).t()


def parameter_seed(seed: int, name: str) -> int:
    """A generator seed per (run seed, parameter name in the single-process model), so a
    parameter's initial value does not depend on construction order or layout."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(name: str, shape: torch.Size, config: GPTConfig, seed: int) -> torch.Tensor:
    """The full (unsharded) initial tensor of parameter `name`, on the CPU in fp32.

    Megatron's init: biases 0, norm weights 1, everything else normal(0, std), except the
    projections that write into the residual stream (attention output, MLP down), whose
    std is divided by sqrt(2 x num_layers) (GPT-2 §2.3) so the residual variance does
    not grow with depth.
    """
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "layernorm" in name:
        return torch.ones(shape)
    std = config.init_method_std
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std /= math.sqrt(2.0 * config.num_layers)
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def initialize_parameters(model: nn.Module, config: GPTConfig, seed: int):
    for name, param in model.named_parameters():
        param.copy_(initial_value(name, param.shape, config, seed))
