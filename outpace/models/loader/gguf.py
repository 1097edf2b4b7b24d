"""Load a llama.cpp GGUF file: metadata -> ModelConfig, tensors -> dequantized HF-named weights.

Why not gguf.GGUFReader for the header: it builds a numpy view per array element, which takes
seconds on the default model just for its 98k tokenizer strings. The header is a simple
length-prefixed format, so `GGUFFile` parses it with `struct` (a small fraction of that) and
maps tensor data with zero-copy numpy views. Tensors are dequantized by gguf_quants.py.

llama.cpp's converter permutes the rows of q/k for Llama (interleaved rope); we undo that on the
raw quantized rows (quant blocks never cross a row) so HF's rotate_half rope applies.

torch is imported by the functions that make tensors: the header and the config read without it,
so that the engine's arguments are checked against the config before torch loads
(engine/preflight.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import mmap
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from outpace.errors import ConfigError, ModelLoadError, UnsupportedModelError
from outpace.model_config import MODEL_SIZE_LIMITS, ModelConfig
from outpace.models.loader.gguf_quants import SUPPORTED_TYPES, QuantizedTensor, dequantize

if TYPE_CHECKING:
    import torch

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS: no tensor has more


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple  # numpy order (rows first), the reverse of GGUF's ne[]
    type_name: str  # GGMLQuantizationType name, e.g. "Q4_1"
    qtype: int
    offset: int  # absolute byte offset in the file
    nbytes: int


def _skip_strings(mm, pos: int, count: int) -> int:
    """The position after `count` length-prefixed strings from `pos`; ValueError if one runs
    past the end of the file."""
    unpack, end = struct.unpack_from, len(mm)
    for _ in range(count):
        pos += 8 + unpack("<Q", mm, pos)[0]
        if pos > end:
            raise ValueError("string runs past the end of the file")
    return pos


class StringArray(Sequence):
    """A metadata array of strings, decoded when first read. The tokenizer's arrays (its tokens
    and merges: ~100k strings in the default model) are read by the tokenizer conversion only,
    which a cached tokenizer skips, and the header is parsed several times a start (the checks,
    then the load): skipping their decoding makes each parse cheap. Its bounds were checked
    when the header was parsed; a string that is not UTF-8 raises UnicodeDecodeError on read."""

    def __init__(self, mm, start: int, count: int):
        self._mm, self._start, self._count = mm, start, count
        self._items: list | None = None

    def _decoded(self) -> list:
        if self._items is None:
            items, mm, pos = [], self._mm, self._start
            for _ in range(self._count):
                n = struct.unpack_from("<Q", mm, pos)[0]
                items.append(mm[pos + 8:pos + 8 + n].decode("utf-8"))
                pos += 8 + n
            self._items = items
        return self._items

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        return self._decoded()[i]

    def tolist(self) -> list:
        return list(self._decoded())


class GGUFFile:
    """A GGUF v2/v3 file: `metadata` (key -> value), `tensors` (name -> TensorInfo), `raw(name)`."""

    def __init__(self, path):
        import gguf  # type table and block sizes
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                # ACCESS_COPY: writable (copy-on-write) views, so torch.from_numpy needs no copy
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:  # ValueError: empty file
            raise ModelLoadError(f"can't read GGUF file {self.path}: {e}") from e
        try:
            self._parse(gguf)
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError, ValueError) as e:
            raise ModelLoadError(
                f"{self.path} is not a valid GGUF file (corrupt or truncated header: {e}); "
                f"download or convert it again") from e

    def _parse(self, gguf) -> None:
        mm, pos = self._mm, 0

        def take(fmt):
            nonlocal pos
            v = struct.unpack_from(fmt, mm, pos)[0]
            pos += struct.calcsize(fmt)
            return v

        def string():
            nonlocal pos
            n = take("<Q")
            if pos + n > len(mm):
                raise ValueError("string runs past the end of the file")
            s = mm[pos:pos + n].decode("utf-8")
            pos += n
            return s

        def value(vtype):
            nonlocal pos
            if vtype in _SCALARS:
                return take(_SCALARS[vtype])
            if vtype == _STRING:
                return string()
            if vtype != _ARRAY:
                raise ValueError(f"unknown metadata value type {vtype}")
            itype, count = take("<I"), take("<Q")
            if itype in _SCALARS and itype != 7:
                dt = np.dtype(_SCALARS[itype])
                arr = np.frombuffer(mm, dtype=dt, count=count, offset=pos).copy()
                pos += dt.itemsize * count
                return arr
            if itype == _STRING:
                start = pos
                pos = _skip_strings(mm, pos, count)
                return StringArray(mm, start, count)
            return [value(itype) for _ in range(count)]

        if mm[:4] != b"GGUF":
            raise ModelLoadError(f"{self.path} is not a GGUF file (no GGUF magic); pass a .gguf "
                                 "file or a Hugging Face model folder")
        pos = 4
        version = take("<I")
        if version not in (2, 3):
            raise UnsupportedModelError(
                f"{self.path}: GGUF version {version} is not supported (only little-endian v2/v3); "
                "re-convert it with a recent llama.cpp")
        n_tensors, n_kv = take("<Q"), take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            self.metadata[key] = value(take("<I"))
        self.metadata_end = pos
        infos = []
        for _ in range(n_tensors):
            name = string()
            n_dims = take("<I")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ModelLoadError(f"{self.path}: tensor {name} has {n_dims} dimensions (GGUF "
                                     f"tensors have 1 to {_MAX_DIMS}); the file is damaged, "
                                     f"download or convert it again")
            dims = [take("<Q") for _ in range(n_dims)]
            infos.append((name, tuple(reversed(dims)), take("<I"), take("<Q")))
        align = self.metadata.get("general.alignment", 32)
        if (isinstance(align, bool) or not isinstance(align, int) or not 1 <= align <= 1 << 20
                or align & (align - 1)):
            raise ModelLoadError(f"{self.path}: general.alignment is {align!r}, not a power of "
                                 f"two; the file is damaged, download or convert it again")
        data_start = (pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, off in infos:
            try:
                t = gguf.GGMLQuantizationType(qtype)
                block, type_size = gguf.GGML_QUANT_SIZES[t]
            except (ValueError, KeyError):
                raise UnsupportedModelError(
                    f"{self.path}: tensor {name} has GGML type {qtype}, which the gguf package "
                    f"does not know (outpace reads {', '.join(SUPPORTED_TYPES)}); the file is "
                    f"damaged, or re-quantize the model to one of those") from None
            # A row is whole quant blocks (ne[0], the last numpy dim, a multiple of the block),
            # so the byte size below is exact and rows can be addressed.
            if min(shape) < 1 or shape[-1] % block:
                raise ModelLoadError(
                    f"{self.path}: tensor {name} has shape {shape}, which a {t.name} tensor "
                    f"can't have (every dim >= 1, rows of whole {block}-value blocks); the file "
                    f"is damaged, download or convert it again")
            # Python integers: a product of lying dims must not wrap around in int64
            n = math.prod(int(d) for d in shape)
            nbytes = n // block * type_size
            type_name = t.name
            start = data_start + off
            if start + nbytes > len(mm):
                raise ModelLoadError(
                    f"{self.path} is truncated: tensor {name} ends at byte {start + nbytes} but "
                    f"the file has {len(mm)} bytes; download it again")
            self.tensors[name] = TensorInfo(name, shape, type_name, qtype, start, nbytes)

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 [rows, bytes_per_row], a view of the file (no copy)."""
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        a = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return a.reshape(rows, info.nbytes // rows)

    def metadata_sha256(self) -> str:
        """Hash of the metadata section: identifies the tokenizer and chat template cheaply."""
        return hashlib.sha256(self._mm[:self.metadata_end]).hexdigest()


# ---- names and config ----------------------------------------------------------------------

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


def hf_name(gguf_name: str):
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unknown."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return None


_REQUIRED = object()


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    from outpace.models.registry import GGUF_ARCHITECTURES
    md, tensors = g.metadata, g.tensors
    raw_arch = md.get("general.architecture")
    arch = GGUF_ARCHITECTURES.get(raw_arch) if isinstance(raw_arch, str) else None
    if arch is None:
        raise UnsupportedModelError(
            f"{g.path}: GGUF architecture {raw_arch!r:.80} is not supported; outpace runs GGUF "
            f"files of {', '.join(GGUF_ARCHITECTURES)} (Llama, Mistral, Qwen2, Qwen3, SmolLM2)")
    p = raw_arch + "."

    def number(key, kind, default=_REQUIRED):
        """Metadata value `key` as `kind` (int or float); a value of another type (a string,
        an array, a bool, a fraction for an int) is an error that names the key."""
        if key not in md:
            if default is _REQUIRED:
                raise ModelLoadError(f"{g.path}: GGUF metadata lacks {key}; re-convert the model")
            return default
        v = md[key]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if ok and kind is int:
            ok = isinstance(v, int) or float(v).is_integer()
        if not ok:
            what = "an integer" if kind is int else "a number"
            raise ModelLoadError(f"{g.path}: GGUF metadata {key} is {v!r:.60}, not {what}; the "
                                 f"file is damaged, download or convert it again")
        return kind(v)

    heads = md.get(p + "attention.head_count")
    if isinstance(heads, (list, np.ndarray)):
        raise UnsupportedModelError(f"{g.path}: per-layer head counts are not supported")
    hidden, heads = number(p + "embedding_length", int), number(p + "attention.head_count", int)
    if heads < 1 or hidden < 1:
        raise ModelLoadError(f"{g.path}: GGUF metadata says {p}attention.head_count = {heads} "
                             f"and {p}embedding_length = {hidden}; both must be >= 1")
    head_dim = number(p + "attention.key_length", int, hidden // heads)
    if number(p + "rope.dimension_count", int, head_dim) != head_dim:
        raise UnsupportedModelError(f"{g.path}: partial rotary embeddings are not supported")
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{g.path} has no token_embd.weight tensor; re-convert the model")
    vocab = tensors["token_embd.weight"].shape[0]  # the embedding, not the token list, decides
    rope_scaling = None
    kind = md.get(p + "rope.scaling.type", "none")
    if not isinstance(kind, str):
        raise ModelLoadError(f"{g.path}: GGUF metadata {p}rope.scaling.type is {kind!r:.60}, "
                             f"not a string; the file is damaged, download or convert it again")
    if kind == "linear":
        rope_scaling = {"rope_type": "linear", "factor": number(p + "rope.scaling.factor", float)}
    elif kind not in ("none", ""):
        raise UnsupportedModelError(f"{g.path}: rope scaling {kind!r:.60} is not supported")
    if "rope_freqs.weight" in tensors:  # Llama 3.1+: llama.cpp stores llama3 scaling as factors
        info = tensors["rope_freqs.weight"]
        if info.nbytes > 4 * MODEL_SIZE_LIMITS["head_dim"]:  # head_dim / 2 values, as F32
            raise ModelLoadError(f"{g.path}: rope_freqs.weight has {math.prod(info.shape)} "
                                 f"values, more than any head_dim / 2; the file is damaged")
        factors = dequantize(g.raw(info), info.type_name, info.shape).reshape(-1)
        rope_scaling = {"rope_type": "freq_factors", "factors": tuple(factors.tolist())}
    eos = [number(k, int) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in md]
    try:
        return ModelConfig(
            architecture=arch, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=number(p + "feed_forward_length", int),
            num_hidden_layers=number(p + "block_count", int), num_attention_heads=heads,
            num_key_value_heads=number(p + "attention.head_count_kv", int, heads),
            head_dim=head_dim,
            rms_norm_eps=number(p + "attention.layer_norm_rms_epsilon", float, 1e-5),
            rope_theta=number(p + "rope.freq_base", float, 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=number(p + "context_length", int, 4096),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            bos_token_id=number("tokenizer.ggml.bos_token_id", int, None),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )
    except ConfigError as e:
        raise ModelLoadError(f"{g.path}: inconsistent GGUF metadata: {e}") from e


def _unpermute_rows(raw: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stored row (h, i, s) where HF has (h, s, i), for s in {0, 1} and i < D/2
    rows = raw.shape[0]
    return (raw.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2)
            .reshape(raw.shape))


def iter_gguf_weights(g: GGUFFile, cfg: ModelConfig, quiet: bool = False, device=None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, QuantizedTensor) for every weight, in file order, with a progress bar."""
    from tqdm import tqdm
    permuted = cfg.architecture in ("llama", "mistral")  # llama.cpp permutes q/k only there
    for info in tqdm(list(g.tensors.values()), desc=f"Loading {g.path.name}", unit="tensor",
                     file=sys.stderr, disable=quiet, leave=False):
        name = hf_name(info.name)
        if name is None:
            continue  # rope_freqs (already in the config) and anything the model doesn't use
        raw = g.raw(info)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                       "k_proj.bias")):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            if len(info.shape) == 1:
                raw = raw.reshape(info.shape[0], -1)
            raw = _unpermute_rows(raw, heads)
        yield name, QuantizedTensor(raw, info.type_name, info.shape, device)


@contextlib.contextmanager
def _one_cpu_thread(device):
    """Dequantize on one CPU thread: the ops are memory-bound, so a second thread gains little,
    and when the cores are shared with other processes OpenMP barriers make it many times
    slower."""
    import torch
    if torch.device(device).type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def load_gguf(path, dtype=None, device="cpu", quiet: bool = False, max_positions=None,
              tp=None):
    """-> (model, ModelConfig, GGUFFile). `path`: a .gguf file, or a GGUFFile already parsed.
    The GGUFFile stays useful for the tokenizer cache key. dtype: the activations' (None:
    float32). max_positions: the positions the rope tables cover (None: the model's
    context_length). tp: a tensor-parallel rank's share (None: the whole model)."""
    import torch
    dtype = torch.float32 if dtype is None else dtype
    from outpace.models.loader.shapes import check_shapes
    from outpace.models.registry import model_class
    g = path if isinstance(path, GGUFFile) else GGUFFile(path)
    cfg = config_from_gguf(g)
    # the metadata against the tensors before anything is allocated from it
    check_shapes(cfg, {hf_name(i.name): i.shape for i in g.tensors.values() if hf_name(i.name)},
                 g.path)
    model = model_class(cfg.architecture)(cfg, dtype=dtype, device=device,
                                          max_positions=max_positions,
                                          **({} if tp is None else {"tp": tp}))
    with _one_cpu_thread(device):
        model.load_weights(iter_gguf_weights(g, cfg, quiet, device))
    return model.eval(), cfg, g
