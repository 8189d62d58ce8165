"""The mixture-of-experts half of hf_convert.py: which HuggingFace class expresses a megalite MoE
model exactly, the HF names of its router, routed and shared experts, and its config fields.
hf_convert.py does the rest (attention, norms, embeddings: Llama's mapping) and the files.

- Mixtral (MixtralForCausalLM): every layer a MoE layer, no shared expert. HF's router takes a
  softmax over all experts, the top k, and renormalises them (MixtralTopKRouter); megalite's
  default (Megatron's, --moe-router-pre-softmax off) softmaxes the top-k logits among
  themselves: the same probabilities, since a softmax restricted to k entries is the full one
  renormalised over them.
- Qwen2-MoE (Qwen2MoeForCausalLM): anything else within reach: dense layers (HF
  `mlp_only_layers`, any --moe-layer-freq), a shared expert, and `norm_topk_prob`: True is
  pre-softmax off, False is --moe-router-pre-softmax (softmax over all, top k, not
  renormalised). HF scales its shared expert's output by sigmoid(shared_expert_gate(x)), a
  gate megalite (like Megatron without --moe-shared-expert-gate) does not have. The export
  writes a zero gate, sigmoid(0) = 1/2 exactly, and the shared expert's down_proj doubled:
  both factors are powers of two, so HF computes megalite's numbers; the import takes only
  a zero gate and halves down_proj back (bit-exact both ways). Without shared experts the
  HF shared expert has width 0 (`shared_expert_intermediate_size` 0), which adds zero.
- Qwen3-MoE (Qwen3MoeForCausalLM): a model with --qk-layernorm (hf_convert.py maps the
  norms, as for Qwen3); Qwen2-MoE's router and dense layers, no shared expert.

Per expert, megalite's fc1 [E, 2F, h] holds [gate; up] of each expert (HF w1 and w3, or
gate_proj and up_proj) and fc2 [E, h, F] its down projection (w2, down_proj). The names
here are the hub's (per expert, as published checkpoints hold them); transformers >= 5
fuses them in memory (`mlp.experts.gate_up_proj` [E, 2F, h], `down_proj` [E, h, F]) and
converts on load and save, which `hub_state_dict` undoes for a loaded model.

Refused by name (ConfigError), as HF would compute something else: the sigmoid score
function and expert bias (DeepSeek-V3's router, not Mixtral's or Qwen's; a model with
--multi-latent-attention is DeepSeek-V3, hf_deepseek.py), a capacity factor
(HF drops no tokens), a shared expert with --qk-layernorm (Qwen3-MoE has none); importing,
Qwen2-MoE's qkv_bias and sliding windows, Mixtral's sliding window and router jitter, and a
trained shared_expert_gate.
"""

import re

import torch

from megalite.config import GPTConfig
from megalite.errors import ConfigError

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
"""HF model_type -> class, of the MoE models here (DeepSeek-V3's is hf_deepseek.py's)."""
GATE_UP_DOWN = (("gate_proj", "up_proj"), ("down_proj",))
"""An expert's HF names of (gate, up) and of down, in Qwen's models and DeepSeek-V3."""
# Per model_type: the MoE block's name and its experts' names (Mixtral's w1, w3 and w2).
EXPERTS = {"mixtral": ("block_sparse_moe", (("w1", "w3"), ("w2",))),
           "qwen2_moe": ("mlp", GATE_UP_DOWN), "qwen3_moe": ("mlp", GATE_UP_DOWN)}
_SHARED = "shared_expert"
_SHARED_GATE = "shared_expert_gate.weight"


def moe_layers(c: GPTConfig) -> list[bool]:
    """Per layer: whether its MLP is a MoE layer."""
    return [c.is_moe_layer(i) for i in range(c.num_layers)]


def differences(c: GPTConfig, wants: dict) -> list[str]:
    """"field=value (needs want)" for each field of `c` that HF needs to be another value."""
    return [f"{name}={getattr(c, name)!r} (needs {want!r})" for name, want in wants.items()
            if getattr(c, name) != want]


def moe_style(c: GPTConfig) -> str:
    """The HF model_type of a MoE model (Llama style otherwise): "mixtral", "qwen2_moe" or,
    with --qk-layernorm, "qwen3_moe"; or a ConfigError naming what none computes."""
    differing = differences(c, dict(moe_router_score_function="softmax",
                                    moe_router_enable_expert_bias=False,
                                    moe_expert_capacity_factor=None))
    if differing:
        raise ConfigError(f"no HuggingFace MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE) computes "
                          f"this model's routing: {', '.join(differing)}")
    if c.qk_layernorm:
        if c.moe_shared_expert_intermediate_size:
            raise ConfigError("qk_layernorm=True with moe_shared_expert_intermediate_size="
                              f"{c.moe_shared_expert_intermediate_size}: Qwen3-MoE, the "
                              "HuggingFace MoE model with QK-norm, has no shared expert")
        return "qwen3_moe"
    mixtral = (all(moe_layers(c)) and not c.moe_shared_expert_intermediate_size
               and not c.moe_router_pre_softmax)
    return "mixtral" if mixtral else "qwen2_moe"


def mlp_modules(ours: str, theirs: str) -> dict[str, tuple[str, ...]]:
    """A SwiGLU MLP's modules under `ours` -> HF's under `theirs`: fc1 is [gate_proj; up_proj]
    (megalite/model/transformer.py's MLP), fc2 is down_proj."""
    return {f"{ours}linear_fc1": (f"{theirs}gate_proj", f"{theirs}up_proj"),
            f"{ours}linear_fc2": (f"{theirs}down_proj",)}


def expert_modules(num_experts: int, block: str = "mlp",
                   names: tuple = GATE_UP_DOWN) -> dict[str, tuple[str, ...]]:
    """megalite's routed experts -> their HF modules (in the layer), expert-major: expert
    0's gate and up, expert 1's, ..."""
    fc1, fc2 = names
    experts = [f"{block}.experts.{e}." for e in range(num_experts)]
    return {"mlp.experts.linear_fc1": tuple(e + n for e in experts for n in fc1),
            "mlp.experts.linear_fc2": tuple(e + n for e in experts for n in fc2)}


def layer_modules(model_type: str, c: GPTConfig, layer: int) -> dict[str, tuple[str, ...]]:
    """megalite module -> its HF modules (in the layer), for the MLP of MoE layer `layer`;
    each takes ".weight"."""
    if not moe_layers(c)[layer]:
        return {}
    block, names = EXPERTS[model_type]
    modules = {"mlp.router": (f"{block}.gate",), **expert_modules(c.num_experts, block, names)}
    if c.moe_shared_expert_intermediate_size:
        modules.update(mlp_modules("mlp.shared_experts.", f"mlp.{_SHARED}."))
    return modules


def join_experts(c: GPTConfig, parts: list[torch.Tensor]) -> torch.Tensor:
    """megalite's [E, ...] expert tensor from its expert-major HF pieces (expert_modules)."""
    return torch.stack(parts).reshape(c.num_experts, -1, parts[0].shape[-1])


def config_kwargs(model_type: str, c: GPTConfig) -> dict:
    """The HF config fields of the MoE part (the Llama ones come from hf_convert.py)."""
    k = dict(num_experts_per_tok=c.moe_router_topk)
    if model_type == "mixtral":
        return dict(k, num_local_experts=c.num_experts, intermediate_size=c.moe_ffn_hidden_size,
                    router_jitter_noise=0.0, sliding_window=None)
    pattern = moe_layers(c)
    qwen = dict(k, num_experts=c.num_experts, moe_intermediate_size=c.moe_ffn_hidden_size,
                norm_topk_prob=not c.moe_router_pre_softmax, decoder_sparse_step=1,
                mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
                use_sliding_window=False)
    if model_type == "qwen3_moe":
        return qwen
    return dict(qwen, shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size or 0,
                qkv_bias=False)


def add_zero_width_expert(hf: dict[str, torch.Tensor], prefix: str, hidden_size: int,
                          like: torch.Tensor) -> None:
    """The HF shared expert of a model without one: 0 wide, it adds zero."""
    for name, shape in (("gate_proj", (0, hidden_size)), ("up_proj", (0, hidden_size)),
                        ("down_proj", (hidden_size, 0))):
        hf[f"{prefix}{name}.weight"] = like.new_zeros(shape)


def add_shared_expert_gate(model_type: str, c: GPTConfig, hf: dict[str, torch.Tensor],
                           prefix: str) -> None:
    """Qwen2-MoE's tensors megalite lacks (module docstring): a zero shared_expert_gate and a
    doubled down_proj in each MoE layer, or a 0-wide shared expert."""
    if model_type != "qwen2_moe":
        return
    for i in (i for i, moe in enumerate(moe_layers(c)) if moe):
        mlp = f"{prefix}{i}.mlp."
        router = hf[f"{mlp}gate.weight"]
        hf[mlp + _SHARED_GATE] = router.new_zeros(1, c.hidden_size)
        if c.moe_shared_expert_intermediate_size:
            hf[f"{mlp}{_SHARED}.down_proj.weight"] = hf[f"{mlp}{_SHARED}.down_proj.weight"] * 2
        else:
            add_zero_width_expert(hf, f"{mlp}{_SHARED}.", c.hidden_size, router)


def remove_shared_expert_gate(sd: dict[str, torch.Tensor], shared: int | None) -> None:
    """The inverse of add_shared_expert_gate on a Qwen2-MoE state dict (hub names), or a
    ConfigError naming a gate megalite cannot express."""
    for name in [n for n in sd if n.endswith("mlp." + _SHARED_GATE)]:
        if sd[name].count_nonzero():
            raise ConfigError(f"HF tensor {name} is not zero: Qwen2-MoE's gate on the shared "
                              "expert has no megalite counterpart (megalite adds the shared "
                              "expert's output ungated)")
        mlp = name[:-len(_SHARED_GATE)]
        del sd[name]
        down = f"{mlp}{_SHARED}.down_proj.weight"
        if shared:
            sd[down] = sd[down] / 2
        else:
            for part in ("gate_proj", "up_proj", "down_proj"):
                del sd[f"{mlp}{_SHARED}.{part}.weight"]


def hub_state_dict(sd: dict[str, torch.Tensor], num_experts: int, block: str = "mlp",
                   names: tuple = GATE_UP_DOWN) -> dict[str, torch.Tensor]:
    """A loaded model's state dict under the hub's per-expert names (module docstring), the
    router as {block}.gate; `block` and `names` as in EXPERTS."""
    out = {}
    for name, t in sd.items():
        fused = re.fullmatch(r"(.*\.)mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)", name)
        if fused is None:
            out[name] = t
        elif fused[2] == "gate.weight":
            out[f"{fused[1]}{block}.gate.weight"] = t
        else:
            parts = names[fused[3] == "down_proj"]
            pieces = t.reshape(num_experts * len(parts), -1, t.shape[-1]).unbind(0)
            for index, piece in enumerate(pieces):
                e, n = divmod(index, len(parts))
                out[f"{fused[1]}{block}.experts.{e}.{parts[n]}.weight"] = piece
    return out


def refuse(name: str, value, want) -> None:
    """A HF config's `name` must be `want`: megalite would compute something else."""
    if value != want:
        raise ConfigError(f"HF config {name}={value!r} is not supported (megalite needs "
                          f"{want!r})")


def moe_fields(hf) -> dict:
    """GPTConfig's MoE fields (and the MLP widths) of a Mixtral or Qwen2-MoE HF config, once
    what megalite would compute differently is refused."""
    layers = hf.num_hidden_layers
    fields = dict(moe_router_topk=hf.num_experts_per_tok, moe_router_score_function="softmax")
    if hf.model_type == "mixtral":
        refuse("sliding_window", getattr(hf, "sliding_window", None), None)
        refuse("router_jitter_noise", getattr(hf, "router_jitter_noise", 0.0) or 0.0, 0.0)
        return dict(fields, num_experts=hf.num_local_experts, moe_layer_pattern=(True,) * layers,
                    moe_ffn_hidden_size=hf.intermediate_size,
                    ffn_hidden_size=hf.intermediate_size, moe_router_pre_softmax=False)
    if hf.model_type == "qwen2_moe":
        refuse("qkv_bias", getattr(hf, "qkv_bias", True), False)
    refuse("use_sliding_window", getattr(hf, "use_sliding_window", False), False)
    skipped = set(hf.mlp_only_layers or ())
    pattern = tuple(i not in skipped and (i + 1) % hf.decoder_sparse_step == 0
                    for i in range(layers))
    return dict(fields, num_experts=hf.num_experts, moe_layer_pattern=pattern,
                moe_ffn_hidden_size=hf.moe_intermediate_size,
                ffn_hidden_size=hf.intermediate_size,
                moe_shared_expert_intermediate_size=getattr(
                    hf, "shared_expert_intermediate_size", None) or None,
                moe_router_pre_softmax=not hf.norm_topk_prob)
