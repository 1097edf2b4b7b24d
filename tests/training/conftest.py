"""Fixtures for the draft-head training tests: the tiny peaked target (tests/speculative) and a prompt
file for it."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_loaded():
    """(model, ModelConfig, TinyTokenizer) of the tiny peaked target (greedy output loops)."""
    from tests.speculative.spec_helpers import tiny_target
    return tiny_target(seed=0)


@pytest.fixture(scope="session")
def tiny_prompts(tmp_path_factory):
    """A JSONL file of 20 short random prompts for the tiny target."""
    from tests.speculative.spec_helpers import write_prompt_file
    return write_prompt_file(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", 20, 24)
