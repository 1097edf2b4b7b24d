"""outpace: an LLM inference engine built around one-model speculative decoding.

Heavy modules (torch, models) load lazily so `import outpace` stays cheap.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "LLMEngine", "RequestOutput"]


def __getattr__(name):
    if name == "SamplingParams":
        from outpace.types import SamplingParams
        return SamplingParams
    if name == "LLM":
        from outpace.entrypoints.llm import LLM
        return LLM
    if name == "LLMEngine":
        from outpace.engine.engine import LLMEngine
        return LLMEngine
    if name == "RequestOutput":
        from outpace.types import RequestOutput
        return RequestOutput
    raise AttributeError(f"module 'outpace' has no attribute {name!r}")
