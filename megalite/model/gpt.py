"""The GPT decoder: embedding -> transformer layers -> final norm -> output layer -> loss.

Activations are sequence-first, [seq, batch, hidden], as in Megatron: sequence
parallelism then splits dim 0, which is contiguous. Under tensor parallelism the
embedding and output layer split the (padded) vocabulary and the loss is the
vocab-parallel cross-entropy, so the full logits are never gathered (docs/design.md §4).
"""

import contextlib

import torch
from torch import nn

from megalite.context_split import local_positions
from megalite.documents import Documents
from megalite.config import GPTConfig
from megalite.model.init import initialize_parameters
from megalite.model.mtp import MultiTokenPrediction, attach_mtp_loss
from megalite.model.norms import build_norm
from megalite.model.rotary import model_rotary_table, uses_rotary
from megalite.model.transformer import SequenceParallelDropout, TransformerLayer
from megalite.parallel_state import group_rank, group_size
from megalite.pipeline_parallel.stages import Stage, rank_stages
from megalite.tensor_parallel.cross_entropy import (vocab_parallel_cross_entropy,
                                                    whole_vocab_cross_entropy)
from megalite.tensor_parallel.fp8 import layer_fp8_recipe
from megalite.tensor_parallel.layers import (ColumnParallelLinear, VocabParallelEmbedding,
                                             column_parallel_linear)
from megalite.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                               scatter_to_sequence_parallel_region)
from megalite.tensor_parallel.params import mark_shared_embedding
from megalite.tensor_parallel.random import checkpoint
from megalite.tensor_parallel.weight_grad import LinearStep


class Embedding(nn.Module):
    def __init__(self, config: GPTConfig, tp_group=None, rng_tracker=None, cp_group=None):
        super().__init__()
        self.config, self.tp_group, self.cp_group = config, tp_group, cp_group
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size,
                                                      config.hidden_size, group=tp_group)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned_absolute" else None)
        self.dropout = SequenceParallelDropout(config, rng_tracker)

    def forward(self, tokens: torch.Tensor, position_offset: int = 0,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] at positions position_offset.. (under CP: this rank's
        chunks, at their global positions), or at `position_ids` [batch, seq] (positions
        within each document) -> [seq, batch, hidden] (this rank's sequence shard under
        SP)."""
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            if position_ids is not None:
                positions = position_ids
            elif group_size(self.cp_group) > 1:
                positions = local_positions(self.config.seq_length, group_size(self.cp_group),
                                            group_rank(self.cp_group), tokens.device)
            else:
                positions = torch.arange(position_offset, position_offset + tokens.shape[1],
                                         device=tokens.device)
            x = x + self.position_embeddings(positions)
        # One copy into the sequence-first layout here: a transposed view would carry its
        # strides into the residual stream, and every norm would copy it again (9 copies
        # forward and more backward in a 4-layer model, instead of one each way).
        x = x.transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        return self.dropout(x)


class Decoder(nn.Module):
    """Transformer layers `layers` (global indices, so parameter names match the
    single-process model whatever the pipeline stage), and the final norm on the last."""

    def __init__(self, config: GPTConfig, layers: range, final_norm: bool, tp_group=None,
                 rng_tracker=None, cp_group=None, ep_group=None):
        super().__init__()
        self.config, self.rng_tracker = config, rng_tracker
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(config, tp_group, rng_tracker, cp_group,
                                      fp8=layer_fp8_recipe(config, i), layer_index=i,
                                      ep_group=ep_group)
             for i in layers})
        self.final_layernorm = build_norm(config) if final_norm else None

    def forward(self, x: torch.Tensor, rope_table: torch.Tensor | None,
                kv_cache=None, documents: Documents | None = None) -> torch.Tensor:
        layers = list(self.layers.values())
        # Generation (the whole model, without grad: nothing to recompute) passes a cache
        # per layer.
        caches = [None] * len(layers) if kv_cache is None else kv_cache.layers
        for run, recompute in recompute_groups(self.config, len(layers)):
            forward = _run_layers(layers[run.start:run.stop], caches[run.start:run.stop])
            if recompute and torch.is_grad_enabled():
                x = checkpoint(forward, self.rng_tracker, x, rope_table, documents)
            else:
                x = forward(x, rope_table, documents)
        return x if self.final_layernorm is None else self.final_layernorm(x)


def recompute_groups(config: GPTConfig, num_layers: int) -> list[tuple[range, bool]]:
    """A chunk's runs of layers, each with whether to recompute it in backward (full
    recompute): uniform keeps only the input of every group of n layers; block recomputes
    the first n layers of this chunk whole and keeps everything of the rest. The memory
    planner counts the same runs."""
    n = config.recompute_num_layers
    if config.recompute_granularity != "full":
        return [(range(num_layers), False)]
    if config.recompute_method == "uniform":
        return [(range(i, min(i + n, num_layers)), True) for i in range(0, num_layers, n)]
    return [(range(i, i + 1), i < n) for i in range(num_layers)]


def _run_layers(layers: list[nn.Module], caches: list):
    def run(x: torch.Tensor, rope_table: torch.Tensor | None,
            documents: Documents | None) -> torch.Tensor:
        for layer, cache in zip(layers, caches):
            x = layer(x, rope_table, cache, documents=documents)
        return x
    return run


class GPTModel(nn.Module):
    """The whole model, or one pipeline stage's chunk of it (`stage`: its layers, with the
    embedding on the first stage and the final norm, output layer and loss on the last),
    and of that this tensor-parallel rank's shard (`tp_group`). Under context parallelism
    (`cp_group`) it runs on this CP rank's chunks of each sequence (context_split.py); its
    MoE layers hold this expert-parallel rank's block of experts (`ep_group`)."""

    def __init__(self, config: GPTConfig, seed: int, tp_group=None, rng_tracker=None,
                 stage: Stage | None = None, cp_group=None, ep_group=None):
        super().__init__()
        self.config, self.tp_group, self.cp_group = config, tp_group, cp_group
        self.stage = stage or Stage(chunk=0, pp_rank=0, pp_size=1, num_chunks=1)
        self.pre_process, self.post_process = self.stage.is_first, self.stage.is_last
        # The MTP modules embed tokens on the last stage: it holds the embedding too.
        mtp = self.post_process and config.mtp_depths > 0
        self.embedding = (Embedding(config, tp_group, rng_tracker, cp_group)
                          if self.pre_process or mtp else None)
        self.decoder = Decoder(config, self.stage.layers(config.num_layers), self.post_process,
                               tp_group, rng_tracker, cp_group, ep_group)
        self.mtp = (MultiTokenPrediction(config, tp_group, rng_tracker, cp_group, ep_group)
                    if mtp else None)
        self.output_layer = None
        tied = not config.untie_embeddings_and_output_weights
        if self.post_process and not (tied and self.embedding is not None):
            self.output_layer = ColumnParallelLinear(config.hidden_size, config.padded_vocab_size,
                                                     group=tp_group, bias=False,
                                                     sequence_parallel=config.sequence_parallel)
            if tied:
                # A tied output layer on a later pipeline stage than the embedding is a copy
                # of the word embeddings: same initial values, grads summed over the
                # embedding group, counted once.
                mark_shared_embedding(self.output_layer.weight, copy=True)
        if self.embedding is not None and (tied or config.mtp_depths > 0):
            # The last stage's embedding (MTP) is such a copy as well, tied or not.
            mark_shared_embedding(self.embedding.word_embeddings.weight,
                                  copy=not self.pre_process)
        # For the tied output layer, a linear without a module of its own (weight_grad.py);
        # the step running the model installs its own here and on every layer.
        self.linear_step = LinearStep()
        self._rotary: torch.Tensor | None = None
        self._rotary_full: torch.Tensor | None = None
        self.register_buffer("padded_vocab_mask", self._padded_vocab_mask(), persistent=False)
        self._compiled_loss = (torch.compile(whole_vocab_cross_entropy)
                               if config.loss_compiled(bool(config.compile_layers),
                                                       group_size(tp_group)) else None)
        initialize_parameters(self, config, seed, group_rank(tp_group), group_size(tp_group),
                              ep_rank=group_rank(ep_group))

    def rope_table(self, device: torch.device) -> torch.Tensor | None:
        """RoPE's cos/sin table [seq_length, 2, rotary dim] (rotary.rotary_table), computed
        once on `device`, the activations' (not the parameters': FSDP2 with CPU offload
        keeps their shards on the host), and read by every layer; under CP only the rows
        of this rank's positions (context_split.local_positions). fp32, and not a buffer:
        .to(bfloat16) would round it, and bf16 angles of neighbouring positions above 256
        are equal."""
        c = self.config
        if not uses_rotary(c):
            return None
        if self._rotary is None or self._rotary.device != device:
            self._rotary = self._rotary_full = model_rotary_table(c, device)
            cp = group_size(self.cp_group)
            if cp > 1:
                self._rotary = self._rotary[local_positions(c.seq_length, cp,
                                                            group_rank(self.cp_group), device)]
        return self._rotary

    def documents(self, document_starts: torch.Tensor | None) -> Documents | None:
        """The documents of this micro-batch's rows (documents.py), from the loader's
        document starts [batch, rows] (this CP rank's rows); None without them (generation,
        or a run without the document flags: plain causal attention, positions 0..s-1)."""
        if document_starts is None or not self.config.uses_documents:
            return None
        cp = group_size(self.cp_group)
        positions = (local_positions(self.config.seq_length, cp, group_rank(self.cp_group))
                     if cp > 1 else torch.arange(document_starts.shape[1]))
        return Documents(document_starts, positions)

    def _padded_vocab_mask(self) -> torch.Tensor | None:
        """True for this rank's output columns that are vocabulary padding. They are masked
        out of the softmax so the padding (which depends on the TP size) cannot change the
        loss: any layout then computes exactly what one process computes."""
        c = self.config
        shard = c.padded_vocab_size // group_size(self.tp_group)
        first = group_rank(self.tp_group) * shard
        vocab = c.vocab_size or c.padded_vocab_size
        if first + shard <= vocab:  # decided on the host: the mask may be built on `meta`
            return None
        return torch.arange(first, first + shard) >= vocab

    def reset_buffers(self, device: torch.device):
        """The padded-vocabulary mask, recomputed on `device` (initialize_buffers)."""
        if self.padded_vocab_mask is not None:
            self.padded_vocab_mask = self._padded_vocab_mask().to(device)

    def output_weight(self) -> torch.Tensor:
        if self.output_layer is None:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None,
                kv_cache=None, document_starts: torch.Tensor | None = None,
                mtp_targets: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """inputs: tokens [batch, seq] on the first stage, else the previous stage's hidden
        states [seq, batch, hidden]. Returns the hidden states unless this is the last
        stage; there, per-token losses [batch, seq] (fp32) when labels are given, else the
        full logits [batch, seq, padded vocab].

        Generation passes a `kv_cache` (megalite/inference.py) holding the keys and values
        of the kv_cache.length positions before inputs; the logits are then those of the
        last position only, [batch, 1, padded vocab] (no [seq, vocab] matrix for a prompt).

        `document_starts` [batch, seq] (this CP rank's rows): each token's document start,
        with --reset-position-ids / --reset-attention-mask (documents.py).

        `mtp_targets`: the micro-batch's (mtp_labels, mtp_loss_mask) [batch, seq, D], which a
        training forward of the last stage with --mtp-num-layers needs: the MTP losses then
        join the gradient, not the returned losses (model/mtp.py)."""
        offset = 0 if kv_cache is None else kv_cache.length
        documents = self.documents(document_starts)
        position_ids = (documents.position_ids()
                        if documents is not None and self.config.resets_positions else None)
        x = self.embedding(inputs, offset, position_ids) if self.pre_process else inputs
        table = self.rope_table(x.device)
        if table is not None:  # with reset positions [seq, batch, 2, rotary dim]
            table = table[offset:] if position_ids is None else self._rotary_full[position_ids.t()]
        x = self.decoder(x, table, kv_cache,
                         documents if self.config.masks_documents else None)
        if not self.post_process:
            return x
        if kv_cache is not None:
            x = x[-1:]
        if labels is None:
            logits = self._vocab_parallel_logits(x)
            return gather_from_tensor_model_parallel_region(logits, self.tp_group).transpose(0, 1)
        losses = self._token_losses(x, labels)
        if self.mtp is not None and self.training:
            if mtp_targets is None:
                raise ValueError("--mtp-num-layers: the micro-batch has no mtp_labels / "
                                 "mtp_loss_mask (data/sampler.add_mtp_targets)")
            losses = attach_mtp_loss(losses, self.mtp(x, labels, mtp_targets, self.embedding,
                                                      table, self._token_losses))
        return losses

    def _token_losses(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token losses [batch, seq] (fp32) of hidden states x [seq, batch, hidden]."""
        if self._compiled_loss is not None:
            return self._compiled_loss(self._vocab_parallel_logits(x, masked=False), labels.t(),
                                       self.padded_vocab_mask).t()
        # Softmax in fp32: in bf16 the log-sum-exp over a large vocabulary loses digits
        # the loss is measured in.
        losses = vocab_parallel_cross_entropy(self._vocab_parallel_logits(x).float(),
                                              labels.t().contiguous(), self.tp_group)
        return losses.t()

    def _vocab_parallel_logits(self, x: torch.Tensor, masked: bool = True) -> torch.Tensor:
        """[seq, batch, padded vocab / TP]: this rank's vocabulary shard of the logits
        (`masked`: the padding's filled with -inf)."""
        if self.output_layer is not None:
            # Called as a module, so its forward hooks run (ZeRO-1's deferred gather).
            logits = self.output_layer(x)
        else:  # tied, on the embedding's own stage
            logits = column_parallel_linear(x, self.embedding.word_embeddings.weight, None,
                                            self.tp_group, self.config.sequence_parallel,
                                            self.linear_step)
        if masked and self.padded_vocab_mask is not None:
            logits = logits.masked_fill(self.padded_vocab_mask, float("-inf"))
        return logits


def build_model_chunks(config: GPTConfig, seed: int, pp_rank: int = 0, pp_size: int = 1,
                       num_chunks: int = 1, tp_group=None, rng_tracker=None,
                       device: torch.device | str | None = None,
                       dtype: torch.dtype | None = None, cp_group=None,
                       layer_counts: tuple[int, ...] | None = None,
                       ep_group=None) -> nn.ModuleList:
    """This pipeline rank's model chunks, one per virtual stage (`chunk.stage`: where it
    sits, docs/design.md §5; `layer_counts`: an uneven split, stages.stage_layer_counts),
    built directly on `device` in `dtype` (default: the CPU, fp32).
    On `meta` the parameters get shapes and tags but no values (no initialisation)."""
    with _creating_parameters(device, dtype):
        return nn.ModuleList(GPTModel(config, seed, tp_group, rng_tracker, stage, cp_group,
                                      ep_group)
                             for stage in rank_stages(pp_rank, pp_size, num_chunks, layer_counts))


@contextlib.contextmanager
def _creating_parameters(device, dtype):
    """Every tensor the layers create inside is born on `device` in `dtype`, so no copy of
    the model exists first on the host or in fp32 (Hugging Face's from_pretrained sets the
    default dtype the same way). The initial values are drawn in fp32 all the same."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype or default)
    try:
        with contextlib.nullcontext() if device is None else torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)


def activation_shape(config: GPTConfig, micro_batch_size: int, tp_size: int,
                     cp_size: int = 1) -> tuple[int, ...]:
    """The hidden states one pipeline stage sends the next, [seq, micro batch, hidden]:
    this CP rank's s / CP rows, and of those this rank's shard under sequence parallelism."""
    seq = config.seq_length // cp_size
    seq = seq // tp_size if config.sequence_parallel else seq
    return (seq, micro_batch_size, config.hidden_size)
