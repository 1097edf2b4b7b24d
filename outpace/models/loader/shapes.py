"""The checkpoint's tensor shapes against the model a config describes, before the model is
allocated.

A config can claim any size within ModelConfig's limits, and the model built from it is
allocated in proportion to those sizes; the checkpoint's tensor shapes (a safetensors or GGUF
header) say what the file really holds. Comparing the two first means the model allocated is
never larger than the weights in the file, and a lying config is an error that names the tensor
and the config fields behind its shape.
"""

from __future__ import annotations

from outpace.errors import ModelLoadError
from outpace.model_config import ModelConfig

# Which config fields a weight's shape comes from, by the end of its HF name.
_FIELDS = (("embed_tokens.weight", ("vocab_size", "hidden_size")),
           ("lm_head.weight", ("vocab_size", "hidden_size")),
           ("q_proj.weight", ("num_attention_heads", "head_dim", "hidden_size")),
           ("q_proj.bias", ("num_attention_heads", "head_dim")),
           ("k_proj.weight", ("num_key_value_heads", "head_dim", "hidden_size")),
           ("v_proj.weight", ("num_key_value_heads", "head_dim", "hidden_size")),
           ("k_proj.bias", ("num_key_value_heads", "head_dim")),
           ("v_proj.bias", ("num_key_value_heads", "head_dim")),
           ("o_proj.weight", ("hidden_size", "num_attention_heads", "head_dim")),
           ("o_proj.bias", ("hidden_size",)),
           ("q_norm.weight", ("head_dim",)), ("k_norm.weight", ("head_dim",)),
           ("gate_proj.weight", ("intermediate_size", "hidden_size")),
           ("up_proj.weight", ("intermediate_size", "hidden_size")),
           ("down_proj.weight", ("hidden_size", "intermediate_size")),
           ("norm.weight", ("hidden_size",)))


def _fields(cfg: ModelConfig, name: str) -> str:
    keys = next((keys for end, keys in _FIELDS if name.endswith(end)), ())
    return ", ".join(f"{k}={getattr(cfg, k)}" for k in keys)


def expected_shapes(cfg: ModelConfig) -> dict:
    """HF weight name -> the shape the model built from `cfg` loads into it (from the model
    itself, built on the meta device: no memory, nothing computed)."""
    from outpace.models.registry import model_class
    model = model_class(cfg.architecture)(cfg, device="meta", max_positions=1)
    return {name: (rows, *dest.shape[1:])
            for name, (dest, _off, rows, *_) in model.param_slices().items()}


def check_shapes(cfg: ModelConfig, shapes: dict, where) -> None:
    """Raise ModelLoadError unless the checkpoint's `shapes` (HF name -> shape) hold every
    weight the model of `cfg` needs, in its shape. `where`: the file or folder, for messages."""
    expected = expected_shapes(cfg)
    for name, shape in expected.items():
        got = shapes.get(name)
        if got is not None and tuple(got) != tuple(shape):
            raise ModelLoadError(
                f"{where}: tensor {name} has shape {tuple(got)}, but the model config "
                f"({_fields(cfg, name)}) expects {tuple(shape)}; the weights do not match the "
                f"config")
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise ModelLoadError(
            f"{where}: the checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. "
            f"{', '.join(missing[:4])}; the files are incomplete or for another architecture "
            f"(or the config's num_hidden_layers={cfg.num_hidden_layers} is wrong)")
