"""Which checkpoints outpace can run, and which model class runs them.

Every supported family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) is the same decoder with small
switches (q/k/v bias, per-head q/k norm, tied embeddings, rope scaling), so one class serves all.
"""

from __future__ import annotations

from typing import Any

from outpace.errors import ConfigError, UnsupportedModelError
from outpace.model_config import SUPPORTED_ARCHITECTURES

# config.json `architectures[0]` -> outpace architecture
_HF_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# config.json `model_type` -> outpace architecture
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# GGUF `general.architecture` -> outpace architecture (Mistral GGUFs say "llama")
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# rope_scaling types the rotary embedding implements ("freq_factors" comes from GGUF rope_freqs)
SUPPORTED_ROPE_TYPES = ("llama3", "linear", "freq_factors")


def _supported() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def architecture_of(d: dict[str, Any]) -> str:
    """Map a config.json dict to 'llama' | 'mistral' | 'qwen2' | 'qwen3'.

    Raises UnsupportedModelError naming the supported families when the checkpoint is something
    else or uses a feature the decoder does not implement (another activation, MLP bias, a rope
    scaling type other than llama3/linear).
    """
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    arch = _MODEL_TYPES.get(model_type)
    if arch is None:
        arch = next((_HF_CLASSES[a] for a in archs if a in _HF_CLASSES), None)
    if arch is None:
        what = model_type or (archs[0] if archs else "unknown")
        raise UnsupportedModelError(
            f"model type {what!r} (architectures={archs}) is not supported; outpace runs the "
            f"{_supported()} families (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)")
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; outpace runs SiLU MLPs")
    if d.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported by outpace's decoder")
    scaling = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling must be an object (or null), got "
                          f"{type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in ("default",) + SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; outpace implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES[:2])} (or none)")
    return arch


def model_class(architecture: str):
    """The nn.Module class for an architecture (all share one decoder)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; outpace runs {_supported()}")
    from outpace.models.llama import LlamaForCausalLM
    return LlamaForCausalLM
