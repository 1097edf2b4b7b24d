"""Engine arguments are checked before the model loads: a wrong one is a ConfigError that
names it, in well under the seconds a load takes."""

from __future__ import annotations

import time

import pytest

from outpace.engine.engine import LLMEngine
from outpace.errors import ConfigError, ModelLoadError


@pytest.mark.parametrize("kw,msg", [
    (dict(max_num_seqs_=4), r"unknown engine argument\(s\) \['max_num_seqs_'\]; the engine "
                            r"takes device, .*max_num_seqs"),
    (dict(max_waiting_requests=0), r"max_waiting_requests must be an integer >= 1 \(it bounds "
                                   r"the queue"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1, got 0"),
    (dict(max_num_seqs="8"), "max_num_seqs must be an integer >= 1, got '8'"),
    (dict(max_model_len=1), "max_model_len must be an integer >= 2"),
    (dict(max_model_len=2.5), "max_model_len must be an integer >= 2"),
    (dict(num_kv_blocks=1), r"num_kv_blocks must be an integer >= 2 \(block 0 is reserved\)"),
    (dict(seed=2 ** 64), "seed must be an integer that fits in 64 bits"),
    (dict(device="tpu"), "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (dict(enforce_eager="no"), "enforce_eager must be true or false, got 'no'"),
    (dict(speculative_config="ngram"), "speculative_config must be a dict"),
    (dict(block_size=12), "block_size must be a power of two"),
    (dict(memory_fraction=1.5), r"memory_fraction must be a number in \(0, 1\]"),
    (dict(gpu_memory_utilization=0), r"^gpu_memory_utilization must be a number in \(0, 1\], "
                                     r"got 0"),
    (dict(gpu_memory_utilization=1.01), r"gpu_memory_utilization .*in \(0, 1\], got 1.01"),
    (dict(gpu_memory_utilization="0.9"), r"gpu_memory_utilization .*in \(0, 1\], got '0.9'"),
    (dict(gpu_memory_utilization=0.9, memory_fraction=0.5),
     "memory_fraction and gpu_memory_utilization both size the KV pool: give one"),
    (dict(speculative_config={"method": "eagle3", "model": "/no/such/head"}),
     r"^speculative_config\['model'\] '/no/such/head' does not exist; give the folder of a "
     r"draft head"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": "four"}),
     "num_speculative_tokens must be an integer in 1..16 .draft tokens per step., got 'four'"),
    (dict(chat_template="/no/such/template.jinja"),
     r"^chat_template '/no/such/template.jinja' does not exist"),
    (dict(chat_template="{% for m in messages %}{{ m.content }}"),
     r"^chat_template: the template given is not a valid Jinja "
     r"template"),
])
def test_bad_engine_arguments_fail_before_the_model_loads(kw, msg):
    t = time.perf_counter()
    with pytest.raises((ConfigError, ModelLoadError), match=msg):
        LLMEngine.from_args("/no/such/model/either", **{"device": "cpu", **kw})
    assert time.perf_counter() - t < 2.0


def test_a_pool_smaller_than_the_context_caps_it_or_is_an_error(caplog):
    """The engine never advertises a context its KV pool can't hold for one request: without a
    max_model_len it caps the context (and warns), with one it refuses (issue 38)."""
    from tests.engine_helpers import make_engine
    from tests.speculative.spec_helpers import tiny_target
    loaded = tiny_target()
    positions = loaded[1].max_position_embeddings
    eng = make_engine(loaded, num_kv_blocks=5)  # 4 usable blocks of 16
    assert positions > 64 and eng.config.max_model_len == 64 == eng.max_model_len
    assert "the KV cache holds 64 tokens of one request" in caplog.text
    with pytest.raises(ConfigError, match=r"holds 64 tokens .*fewer than max_model_len=100: "
                                          r"raise num_kv_blocks"):
        make_engine(loaded, num_kv_blocks=5, max_model_len=100)
    assert make_engine(loaded, num_kv_blocks=5, max_model_len=64).max_model_len == 64


def test_gpu_memory_utilization_is_accepted_and_ignored_on_cpu(caplog):
    """A vLLM command line with --gpu-memory-utilization runs on CPU unchanged: the value is
    checked, a warning says it is ignored, and the pool is the CPU pool."""
    from tests.engine_helpers import make_engine
    from tests.speculative.spec_helpers import tiny_target
    loaded = tiny_target()
    ref = make_engine(loaded, num_kv_blocks=None)
    assert "ignored" not in caplog.text
    eng = make_engine(loaded, num_kv_blocks=None, gpu_memory_utilization=0.5)
    assert "gpu_memory_utilization (--gpu-memory-utilization) is ignored on cpu" in caplog.text
    assert eng.config.cache.gpu_memory_utilization == 0.5
    assert eng.kv.num_blocks == ref.kv.num_blocks


def test_a_lent_model_whose_rope_tables_are_shorter_than_the_context_is_refused():
    from outpace.models.llama import LlamaForCausalLM
    from tests.engine_helpers import make_engine
    from tests.speculative.spec_helpers import tiny_target
    _, cfg, tok = tiny_target()
    short = LlamaForCausalLM(cfg, max_positions=32)
    with pytest.raises(ConfigError, match=r"the loaded model's rope tables cover 32 positions, "
                                          r"fewer than max_model_len=64"):
        make_engine((short, cfg, tok), max_model_len=64)


def test_every_engine_argument_is_an_engine_args_field_with_its_default():
    """EngineArgs is the one list of the engine's arguments: from_args takes exactly its fields
    (with its defaults for those left out), and the CLI's engine flags fill only fields of it,
    their --help defaults being its defaults."""
    import dataclasses

    from outpace.engine.args import EngineArgs
    from outpace.entrypoints.cli import build_parser
    from outpace.entrypoints.cli_options import engine_kwargs, model_of
    names = EngineArgs.names()
    assert "model" not in names and {"device", "max_num_seqs", "loaded"} <= set(names)
    args = EngineArgs.from_kwargs("m", max_num_seqs=3)
    assert args.model == "m" and args.max_num_seqs == 3
    assert dataclasses.replace(args, max_num_seqs=64) == EngineArgs(model="m")
    a = build_parser().parse_args(["generate", "hi"])
    kw = engine_kwargs(a)
    assert set(kw) <= set(names)
    defaults = EngineArgs()
    assert model_of(a) == defaults.model
    for name, value in kw.items():
        if name != "speculative_config":
            assert value == getattr(defaults, name), name


def test_an_unknown_engine_argument_names_the_close_ones():
    with pytest.raises(ConfigError, match=r"\['max_num_seq'\]; the engine takes device, .* "
                                          r"\(max_num_seq: did you mean max_num_seqs\?\)$"):
        LLMEngine.from_args("m", max_num_seq=4)
    with pytest.raises(ConfigError, match=r"\['zzz'\]; the engine takes .*, loaded$"):
        LLMEngine.from_args("m", zzz=4)


def test_kernel_options_must_be_kernel_options():
    with pytest.raises(ConfigError, match="kernel_options must be a KernelOptions .*got dict") \
            as e:
        LLMEngine.from_args("/no/such/model/either", device="cpu", kernel_options={"pdl": False})
    assert e.value.option == "kernel_options"


def test_force_accept_mean_warns_that_the_output_changes(caplog):
    """A benchmarking option that changes the output says so, loudly, whenever it is set."""
    from tests.engine_helpers import make_engine
    from tests.speculative.spec_helpers import tiny_target
    loaded = tiny_target()
    make_engine(loaded, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert "force_accept_mean" not in caplog.text
    make_engine(loaded, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                            "force_accept_mean": 2})
    assert ("WARNING: speculative option force_accept_mean=2 is for benchmarking: drafts are "
            "accepted at random, so the output is NOT what the model would write") in caplog.text
