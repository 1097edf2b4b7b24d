"""transformers' own model of the default GGUF, the reference the end-to-end and model tests
compare with."""

from __future__ import annotations


def load_hf_default_model(default_gguf):
    """transformers' own GGUF loading of the default model (slow: it dequantizes every tensor).
    The folders whose tests compare with it (e2e, models) each load it for themselves, as a
    package fixture, so that the rest of the session does not hold it."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32)
    finally:
        logging.enable_progress_bar()
    return model.eval()
