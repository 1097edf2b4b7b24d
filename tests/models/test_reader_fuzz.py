"""Fuzz of the GGUF and config.json readers: random truncations and mutated header fields and
values of a small valid GGUF file and config.json (seeded, so a failure repeats). Every case
loads or raises the project's own error (ModelLoadError / ConfigError): never another exception,
never an allocation out of proportion to the file (the address space is capped while the cases
run), and the whole fuzz takes seconds."""

from __future__ import annotations

import contextlib
import json
import math
import random
import struct
import time
import traceback

import pytest
import torch

from outpace.errors import ConfigError, ModelLoadError
from outpace.model_config import MODEL_SIZE_LIMITS
from outpace.models.loader.gguf import load_gguf
from outpace.models.loader.safetensors import load_hf_folder
from tests.models.helpers import write_gguf

# The engine builds rope tables for its context, not the file's claim (rotary.py): the loaders
# are called as the engine calls them.
POSITIONS = 256
# Address space the cases may take beyond what the process has mapped when they start: the
# fuzzed model's weights are kilobytes; an allocation sized by a lying field is far larger.
EXTRA_ADDRESS_SPACE = 1 << 30


def _tiny_llama():
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@contextlib.contextmanager
def capped_address_space(extra: int):
    """RLIMIT_AS at what is mapped now plus `extra` (Linux), restored after: a huge allocation
    fails at once instead of taking the machine's memory."""
    try:
        import resource
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (ImportError, OSError, StopIteration):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm + extra if hard == resource.RLIM_INFINITY else min(vm + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_cases(cases, load):
    """cases: (description, payload); load(payload) loads it -> the failures: (description,
    traceback) of every case that raised anything but ModelLoadError / ConfigError."""
    failures = []
    with capped_address_space(EXTRA_ADDRESS_SPACE):
        for what, payload in cases:
            try:
                load(payload)
            except (ModelLoadError, ConfigError):
                pass
            except BaseException as e:  # noqa: BLE001 - what the fuzz looks for
                if isinstance(e, KeyboardInterrupt):
                    raise
                failures.append((what, traceback.format_exc(limit=-3)))
    return failures


def _report(failures) -> str:
    return f"{len(failures)} case(s) escaped:\n" + "\n".join(
        f"--- {what}\n{tb}" for what, tb in failures[:8])


# ---- GGUF --------------------------------------------------------------------------------------

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


def gguf_fields(data: bytes) -> list:
    """Every header field of a GGUF file as (offset, struct format, label), in file order."""
    fields, pos = [], 4

    def take(fmt, label):
        nonlocal pos
        fields.append((pos, fmt, label))
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string(label):
        nonlocal pos
        n = take("<Q", label + " length")
        s = data[pos:pos + n].decode()
        pos += n
        return s

    def value(vtype, label):
        nonlocal pos
        if vtype in _SCALAR:
            return take(_SCALAR[vtype], label)
        if vtype == 8:
            return string(label)
        itype, count = take("<I", label + " item type"), take("<Q", label + " count")
        for i in range(count):
            value(itype, f"{label}[{i}]")

    take("<I", "version")
    n_tensors, n_kv = take("<Q", "tensor count"), take("<Q", "metadata count")
    for _ in range(n_kv):
        key = string("key")
        value(take("<I", f"{key} type"), f"{key} value")
    for _ in range(n_tensors):
        name = string("tensor name")
        n_dims = take("<I", f"{name} n_dims")
        for d in range(n_dims):
            take("<Q", f"{name} dim {d}")
        take("<I", f"{name} type")
        take("<Q", f"{name} offset")
    return fields


def _int_values(fmt: str, orig: int, rng: random.Random) -> list:
    bits = struct.calcsize(fmt) * 8
    signed = fmt[1].islower()
    lo, hi = (-(1 << bits - 1), (1 << bits - 1) - 1) if signed else (0, (1 << bits) - 1)
    pool = [0, 1, 2, 3, 7, 31, 32, 255, 4096, 1 << 22, 1 << 24, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 40,
            (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -1, -(1 << 31), orig + 1, orig - 1, orig * 2,
            orig * 1000, orig << 20, rng.getrandbits(bits)]
    return [v for v in pool if lo <= v <= hi]


def _float_values(orig: float) -> list:
    return [0.0, -0.0, -1.0, math.nan, math.inf, -math.inf, 1e-45, 3e38, orig * 1e6, -orig]


def gguf_cases(data: bytes, seed: int = 0, per_field: int = 3):
    """(description, bytes): truncations, each header field set to a few hostile values, and
    garbage written over random header spans."""
    rng = random.Random(seed)
    fields = gguf_fields(data)
    header_end = fields[-1][0] + struct.calcsize(fields[-1][1])
    cuts = sorted({0, 3, 4, 8, 16, 24, len(data) - 1, header_end, header_end + 1}
                  | {rng.randrange(len(data)) for _ in range(40)}
                  | {rng.randrange(header_end) for _ in range(20)})
    for cut in cuts:
        yield f"truncated at {cut} of {len(data)}", data[:cut]
    for pos, fmt, label in fields:
        orig = struct.unpack_from(fmt, data, pos)[0]
        if fmt in ("<f", "<d"):
            values = _float_values(orig)
        elif fmt == "<?":
            values = [2, 255]
            fmt = "<B"
        else:
            values = _int_values(fmt, orig, rng)
        for v in rng.sample(values, min(per_field, len(values))):
            bad = bytearray(data)
            struct.pack_into(fmt, bad, pos, v)
            yield f"{label} (byte {pos}) = {v!r} (was {orig!r})", bytes(bad)
    for _ in range(40):
        at = rng.randrange(4, header_end)
        n = rng.choice((1, 2, 4, 8, 16))
        bad = bytearray(data)
        bad[at:at + n] = bytes(rng.getrandbits(8) for _ in range(len(bad[at:at + n])))
        yield f"{n} random bytes at {at}", bytes(bad)


# The base's linear rope scaling: every branch of the reader has something to misread.
SCALING_TYPE = "llama.rope.scaling.type"
SCALING = {SCALING_TYPE: "linear", "llama.rope.scaling.factor": 2.0}


def _write_base(model, path, metadata=None, extra_kv=SCALING):
    return write_gguf(model, path, "Q8_0", rope_freqs=torch.ones(8), metadata=metadata,
                      extra_kv=extra_kv)


@pytest.fixture(scope="module")
def tiny_llama():
    return _tiny_llama()


@pytest.fixture(scope="module")
def base_gguf(tiny_llama, tmp_path_factory):
    """A small valid GGUF: Q8_0 matrices, F32 norms, a rope_freqs tensor, rope scaling keys."""
    path = _write_base(tiny_llama, tmp_path_factory.mktemp("fuzz") / "base.gguf")
    load_gguf(path, quiet=True, max_positions=POSITIONS)  # the base itself loads
    return path.read_bytes()


def test_gguf_reader_fuzz(base_gguf, tmp_path):
    path = tmp_path / "case.gguf"

    def load(data):
        path.write_bytes(data)
        load_gguf(path, quiet=True, max_positions=POSITIONS)

    cases = list(gguf_cases(base_gguf))
    assert len(cases) > 300
    t = time.perf_counter()
    failures = run_cases(cases, load)
    assert not failures, _report(failures)
    assert time.perf_counter() - t < 30.0


# write_gguf's GGUFWriter calls -> the metadata key each writes
_WRITER_KEYS = {"add_block_count": "llama.block_count",
                "add_context_length": "llama.context_length",
                "add_embedding_length": "llama.embedding_length",
                "add_feed_forward_length": "llama.feed_forward_length",
                "add_head_count": "llama.attention.head_count",
                "add_head_count_kv": "llama.attention.head_count_kv",
                "add_key_length": "llama.attention.key_length",
                "add_rope_dimension_count": "llama.rope.dimension_count",
                "add_rope_freq_base": "llama.rope.freq_base",
                "add_layer_norm_rms_eps": "llama.attention.layer_norm_rms_epsilon",
                "add_bos_token_id": "tokenizer.ggml.bos_token_id",
                "add_eos_token_id": "tokenizer.ggml.eos_token_id"}
# a value of another type (or none): writer method, value
_RETYPED = [(None, None), ("add_string", "abc"), ("add_string", "16"), ("add_float32", 1.5),
            ("add_float32", math.nan), ("add_bool", True), ("add_array", [1, 2]),
            ("add_int32", -1), ("add_uint64", (1 << 64) - 1), ("add_float64", 1e300)]


def test_gguf_metadata_of_the_wrong_type_fuzz(tiny_llama, tmp_path):
    """Each metadata value the reader uses, missing or written as another GGUF type."""
    path = tmp_path / "case.gguf"

    def write(call, key, method, v):
        if method is None:
            return {call: lambda w: None}
        return {call: lambda w: getattr(w, method)(key, v)}

    cases = [(f"{key} {'missing' if m is None else f'as {m[4:]} {v!r}'}",
              (write(call, key, m, v), SCALING))
             for call, key in _WRITER_KEYS.items() for m, v in _RETYPED]
    for key in SCALING:  # write_gguf picks the writer method by the Python type
        for v in (None, "abc", "16", 1.5, 0.0, -2.0, math.nan, True, [1, 2], 7):
            extra = {k: w for k, w in SCALING.items() if k != key}
            if v is not None:
                extra[key] = v
            cases.append((f"{key} = {v!r}", (None, extra)))
    cases.append(("rope scaling type yarn", (None, {**SCALING, SCALING_TYPE: "yarn"})))

    def load(payload):
        metadata, extra = payload
        _write_base(tiny_llama, path, metadata, extra)
        load_gguf(path, quiet=True, max_positions=POSITIONS)

    t = time.perf_counter()
    failures = run_cases(cases, load)
    assert not failures, _report(failures)
    assert time.perf_counter() - t < 30.0


# ---- config.json -------------------------------------------------------------------------------

_HOSTILE = [None, True, False, 0, 1, -1, 2, 3, 7, 1 << 31, 1 << 63, 10 ** 30, -(10 ** 30), 0.5,
            1.5, 1e-300, math.nan, math.inf, -math.inf, "abc", "", "16", [], [1], [1, 2, 3],
            {}, {"a": 1}, {"rope_type": "linear"}, [[[[]]]], "x" * 1000]
_ROPE = [{"rope_type": t, **extra} for t in ("linear", "llama3", "default", "yarn", None, 3)
         for extra in ({}, {"factor": 2.0}, {"factor": -1}, {"factor": "2"},
                       {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32},
                       {"factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32},
                       {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 0})]


def config_cases(d: dict, seed: int = 0):
    """(description, config.json text): each key deleted or set to hostile values, rope
    scaling dicts, and the text truncated or garbled."""
    rng = random.Random(seed)
    keys = sorted(d) + ["head_dim", "rope_parameters", "rope_scaling", "eos_token_id",
                        "bos_token_id", "architectures", "model_type"]
    for key in sorted(set(keys)):
        if key in d:
            yield f"no {key}", json.dumps({k: v for k, v in d.items() if k != key})
        for v in rng.sample(_HOSTILE, 8):
            yield f"{key} = {v!r:.40}", json.dumps({**d, key: v})
        if key in MODEL_SIZE_LIMITS:  # the largest size accepted: a model of gigabytes
            yield f"{key} = {MODEL_SIZE_LIMITS[key]}", json.dumps(
                {**d, key: MODEL_SIZE_LIMITS[key]})
    for sc in _ROPE:
        yield f"rope_scaling = {sc}", json.dumps({**d, "rope_scaling": sc})
        yield f"rope_parameters = {sc}", json.dumps({**d, "rope_parameters": {**sc,
                                                                             "rope_theta": 1e4}})
    text = json.dumps(d)
    for cut in sorted({rng.randrange(len(text)) for _ in range(20)}):
        yield f"config.json truncated at {cut}", text[:cut]
    for _ in range(20):
        at = rng.randrange(len(text))
        yield f"garbage at {at}", text[:at] + rng.choice(["\x00", "}", "{", "\"", "\\", "\udcff",
                                                          "1e999", "-"]) + text[at + 1:]


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz-hf")
    _tiny_llama().save_pretrained(folder)
    load_hf_folder(folder, quiet=True, max_positions=POSITIONS)
    return folder


def test_config_reader_fuzz(base_folder):
    config = base_folder / "config.json"
    d = json.loads(config.read_text())

    def load(text):
        config.write_bytes(text.encode("utf-8", "surrogatepass"))
        load_hf_folder(base_folder, quiet=True, max_positions=POSITIONS)

    cases = list(config_cases(d))
    assert len(cases) > 300
    t = time.perf_counter()
    failures = run_cases(cases, load)
    assert not failures, _report(failures)
    assert time.perf_counter() - t < 30.0
