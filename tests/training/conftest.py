"""Fixtures for the draft-head training tests: the tiny peaked target (tests/speculative) and a prompt
file for it."""

import json
import os
import random

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
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(20):
            text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(6, 24)))
            f.write(json.dumps({"id": f"p{i}", "prompt": text}) + "\n")
    return path
