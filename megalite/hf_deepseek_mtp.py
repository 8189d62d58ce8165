"""DeepSeek-V3's multi-token-prediction weights in a HuggingFace folder, as DeepSeek's
checkpoints keep them: depth k (k = 0..D-1) is layer num_layers + k, holding enorm, hnorm,
eh_proj, shared_head.norm (megalite's final_layernorm of the depth), a transformer layer's
tensors under their usual names, and copies of the embedding (embed_tokens) and of the output
layer (shared_head.head). config.json gives D as num_mtp_layers (transformers') and
num_nextn_predict_layers (DeepSeek's).

transformers' DeepseekV3ForCausalLM does not load these (its _keys_to_ignore_on_load_unexpected),
so the import reads them from the folder's safetensors files: the depths it finds are the
model's --mtp-num-layers. megalite shares the embedding and the output layer with its depths,
so copies that differ from the main model's are refused by name.
"""

import re
import warnings
from pathlib import Path

import torch

from megalite.errors import ConfigError
from megalite.hf_deepseek import MTP_COPIES

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def read_mtp(directory: str | Path, hf_config) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors of the layers after num_hidden_layers in `directory`'s safetensors files
    (the hub's names, experts per expert), and how many depths they hold."""
    from safetensors import safe_open  # a dependency of transformers

    first, found = hf_config.num_hidden_layers, {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                layer = _LAYER.match(name)
                if layer and int(layer[1]) >= first:
                    found[name] = f.get_tensor(name)
    depths = sorted({int(_LAYER.match(n)[1]) - first for n in found})
    if depths != list(range(len(depths))):
        raise ConfigError(f"{directory}: the multi-token-prediction layers after layer "
                          f"{first - 1} are not consecutive: {[first + d for d in depths]}")
    said = getattr(hf_config, "num_mtp_layers", None) or getattr(
        hf_config, "num_nextn_predict_layers", None) or 0
    if said != len(depths):
        warnings.warn(f"{directory}: config.json gives {said} multi-token-prediction layers, "
                      f"its weights hold {len(depths)}: importing {len(depths)}")
    return found, len(depths)


def drop_shared_copies(sd: dict[str, torch.Tensor], num_layers: int, depths: int) -> None:
    """Remove each depth's copies of the embedding and output layer from `sd` (a loaded
    model's state dict with read_mtp's tensors), refusing copies that differ."""
    for k in range(depths):
        for copy, main in MTP_COPIES.items():
            name = f"model.layers.{num_layers + k}.{copy}"
            if name in sd and not torch.equal(sd.pop(name), sd[main]):
                raise ConfigError(f"HF tensor {name} differs from {main}: megalite's "
                                  "multi-token prediction shares the embedding and the output "
                                  "layer with the main model")
