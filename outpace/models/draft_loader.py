"""Draft-head checkpoints (EAGLE-3, MTP): the file format, its validation, loading and saving.

A draft head folder holds config.json and *.safetensors (pytorch_model*.bin is read too, as the
EAGLE authors released theirs). The head runs inside the target's KV pool and vocabulary, so
every shape that touches them is checked against the target's ModelConfig before a weight is
copied, and each mismatch names the field, both values and what to do about it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Optional, Union

import torch

from outpace.errors import ConfigError, ModelLoadError
from outpace.model_config import ModelConfig
from outpace.models.cpu_fast_paths import add_weight_copies_
from outpace.models.eagle3 import Eagle3Config, Eagle3Head
from outpace.models.mtp import MTPHead
from outpace.models.weight_dtype import store_weights_in_

log = logging.getLogger(__name__)

DRAFT_METHODS = ("eagle3", "mtp")
_HF_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# ---- checkpoint names -> parameters ---------------------------------------------------------


def decoder_layer_slices(layer, prefix: str) -> dict:
    """HF names of one LlamaDecoderLayer -> (tensor, first row, rows) of its fused parameters."""
    a, mlp = layer.self_attn, layer.mlp
    out = {prefix + "input_layernorm.weight": (layer.input_layernorm.weight, 0, None),
           prefix + "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight,
                                                        0, None),
           prefix + "self_attn.o_proj.weight": (a.o_weight, 0, None),
           prefix + "mlp.gate_proj.weight": (mlp.gate_up_weight, 0, mlp.inter),
           prefix + "mlp.up_proj.weight": (mlp.gate_up_weight, mlp.inter, mlp.inter),
           prefix + "mlp.down_proj.weight": (mlp.down_weight, 0, None)}
    offs = {"q": (0, a.q_size), "k": (a.q_size, a.kv_size), "v": (a.q_size + a.kv_size, a.kv_size)}
    for n, (off, rows) in offs.items():
        out[f"{prefix}self_attn.{n}_proj.weight"] = (a.qkv_weight, off, rows)
        if a.qkv_bias is not None:
            out[f"{prefix}self_attn.{n}_proj.bias"] = (a.qkv_bias, off, rows)
    if a.o_bias is not None:
        out[prefix + "self_attn.o_proj.bias"] = (a.o_bias, 0, None)
    if a.q_norm is not None:
        out[prefix + "self_attn.q_norm.weight"] = (a.q_norm.weight, 0, None)
        out[prefix + "self_attn.k_norm.weight"] = (a.k_norm.weight, 0, None)
    return out


def head_slices(head) -> dict:
    """Checkpoint name -> (tensor, first row, rows) for every tensor of an EAGLE-3 or MTP head."""
    if isinstance(head, Eagle3Head):
        out = {"fc.weight": (head.fc_weight, 0, None),
               "midlayer.hidden_norm.weight": (head.hidden_norm.weight, 0, None),
               "norm.weight": (head.norm.weight, 0, None),
               "lm_head.weight": (head.lm_head_weight, 0, None),
               "d2t": (head.d2t, 0, None), "t2d": (head.t2d, 0, None)}
        if head.embed_weight is not None:
            out["embed_tokens.weight"] = (head.embed_weight, 0, None)
        out.update(decoder_layer_slices(head.midlayer, "midlayer."))
    else:
        out = {}
        for d, m in enumerate(head.layers):
            p = f"layers.{d}."
            out[p + "enorm.weight"] = (m.enorm.weight, 0, None)
            out[p + "hnorm.weight"] = (m.hnorm.weight, 0, None)
            out[p + "eh_proj.weight"] = (m.eh_proj_weight, 0, None)
            if m.shared_head_norm is not None:
                out[p + "shared_head.norm.weight"] = (m.shared_head_norm.weight, 0, None)
            out.update(decoder_layer_slices(m.layer, p))
    return {k: (t, off, t.shape[0] if rows is None else rows) for k, (t, off, rows) in out.items()}


def _rank_share(whole, tp, build):
    """The head `build(tp=tp)` holding rank tp.rank's share of the loaded `whole`: its decoder
    layers' parts (LlamaDecoderLayer.load_part_of_), everything else copied as is."""
    from outpace.parallel.shard import check_shardable
    layer_cfg = whole.config.layer if isinstance(whole, Eagle3Head) else whole.config
    try:
        check_shardable(layer_cfg, tp.size)
    except ConfigError as e:
        raise ConfigError(f"the draft head's layer: {e}", option=e.option) from None
    part = build(tp=tp)
    with torch.no_grad():
        for mine, theirs in _decoder_layers(part, whole):
            mine.load_part_of_(theirs)
        theirs = whole.state_dict()
        for name, t in part.state_dict().items():
            if t.shape == theirs[name].shape:  # not a sharded matrix: the same on every rank
                t.copy_(theirs[name])
    return part


def _decoder_layers(a, b) -> list:
    if isinstance(a, Eagle3Head):
        return [(a.midlayer, b.midlayer)]
    return [(ma.layer, mb.layer) for ma, mb in zip(a.layers, b.layers)]


def export_weights(head) -> dict:
    """The head's tensors under their checkpoint names (CPU, contiguous): what save writes."""
    return {name: t.detach().narrow(0, off, rows).to("cpu").contiguous()
            for name, (t, off, rows) in sorted(head_slices(head).items())}

# ---- config.json ------------------------------------------------------------------------------


def model_config_dict(cfg: ModelConfig) -> dict:
    """A transformers-style config.json dict that ModelConfig.from_hf_dict reads back as `cfg`."""
    d = {"architectures": [_HF_CLASS[cfg.architecture]], "model_type": cfg.architecture,
         "hidden_act": "silu", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
         "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
         "num_attention_heads": cfg.num_attention_heads,
         "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
         "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
         "max_position_embeddings": cfg.max_position_embeddings,
         "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
         "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
    if cfg.rope_scaling:
        d["rope_scaling"] = {k: list(v) if isinstance(v, tuple) else v
                             for k, v in cfg.rope_scaling.items()}
    return d


def eagle3_config_dict(cfg: Eagle3Config) -> dict:
    d = model_config_dict(cfg.layer)
    d.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
             tie_word_embeddings=False, draft_vocab_size=cfg.draft_vocab_size,
             eagle_config={"eagle_aux_hidden_state_layer_ids": list(cfg.resolved_aux_layer_ids)})
    if cfg.norm_before_residual:
        d["norm_before_residual"] = True
    return d


def mtp_config_dict(layer_cfg: ModelConfig, num_modules: int) -> dict:
    d = model_config_dict(layer_cfg)
    d["num_nextn_predict_layers"] = num_modules
    return d


def save_draft_head(config: dict, tensors: dict, out_dir: Union[str, Path]) -> Path:
    """Write config.json and model.safetensors ({checkpoint name: tensor}, e.g. export_weights
    of a head) into out_dir, created if needed."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out

# ---- reading ----------------------------------------------------------------------------------


def _read_config(path: Path) -> tuple:
    """-> (config dict, the weight files). Raises ModelLoadError."""
    if not path.is_dir():
        raise ModelLoadError(f"draft head folder {str(path)!r} does not exist (or is not a "
                             f"folder); pass the folder written by `outpace init-draft` or a "
                             f"released EAGLE-3/MTP checkpoint")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json; a draft head folder needs config.json "
                             f"and model.safetensors")
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from e
    except RecursionError:
        raise ModelLoadError(f"{cfg_file} nests too deeply to be a draft head's config") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{cfg_file} is not a JSON object; it is not a draft head's config")
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors (or pytorch_model.bin) weight file; "
                             f"the draft head folder is incomplete")
    return config, files


def _checkpoint_name(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


# A safetensors header larger than this is no draft head's (a head has some dozens of tensors).
_MAX_HEADER_BYTES = 100 << 20


def _tensor_names(files: list) -> Optional[set]:
    """The checkpoint's tensor names from the safetensors headers (read as bytes: no weight is
    read or mapped); None for pytorch_model*.bin files, which are read whole to learn them."""
    if files[0].suffix != ".safetensors":
        return None
    names = set()
    for f in files:
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 2 <= n <= min(f.stat().st_size - 8, _MAX_HEADER_BYTES):
                    raise ValueError(f"a header of {n} bytes")
                header = json.loads(fh.read(n))
            if not isinstance(header, dict):
                raise ValueError("a header that is not a JSON object")
        except (OSError, ValueError, RecursionError) as e:
            raise ModelLoadError(f"can't read draft head weights {f}: it is not a safetensors "
                                 f"file ({e})") from e
        names.update(_checkpoint_name(k) for k in header if k != "__metadata__")
    return names


def _read_tensors(files: list) -> dict:
    """{checkpoint name: CPU tensor} of every weight file."""
    tensors = {}
    for f in files:
        try:
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file
                part = load_file(str(f))
            else:
                part = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # corrupt or truncated file: say which one
            raise ModelLoadError(f"can't read draft head weights {f}: {e}") from e
        for name, t in part.items():
            tensors[_checkpoint_name(name)] = t
    return tensors


def _vllm_names(names) -> dict:
    """vLLM-style EAGLE-3 exports name the one layer layers.0 instead of midlayer: the
    checkpoint's name -> ours."""
    return {n: "midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n
            for n in names}


def _same(path, what: str, draft, target, why: str) -> None:
    if draft != target:
        raise ModelLoadError(f"draft head {path}: {what}={draft}, but the target has "
                             f"{what}={target}; {why}")


def _check_attention_shape(path, cfg: ModelConfig, target_cfg: ModelConfig) -> None:
    why = ("the head's KV lives in the target's KV pool and attention backend, so its attention "
           "heads must have the target's layout; use a head trained for this target")
    _same(path, "hidden_size", cfg.hidden_size, target_cfg.hidden_size,
          "this head was trained for another model; use a head made for this target")
    _same(path, "num_attention_heads", cfg.num_attention_heads, target_cfg.num_attention_heads, why)
    _same(path, "num_key_value_heads", cfg.num_key_value_heads, target_cfg.num_key_value_heads, why)
    _same(path, "head_dim", cfg.head_dim, target_cfg.head_dim, why)


def _copy_weights(head, tensors: dict, path, known_unused=()) -> None:
    """known_unused: names the head reads elsewhere and drops here without a warning."""
    slots = head_slices(head)
    missing = sorted(set(slots) - set(tensors))
    if missing:
        raise ModelLoadError(
            f"draft head {path} lacks {len(missing)} tensor(s) the head needs, e.g. "
            f"{', '.join(missing[:4])}; the files are incomplete or for another head type")
    unused = sorted(n for n in tensors if n not in slots and n not in known_unused
                    and not n.endswith("inv_freq"))
    if unused:
        log.warning("draft head %s: ignoring %d unknown tensor(s), e.g. %s", path, len(unused),
                    ", ".join(unused[:4]))
    with torch.no_grad():
        for name, (dest, off, rows) in slots.items():
            part, t = dest.narrow(0, off, rows), tensors[name]
            if tuple(part.shape) != tuple(t.shape):
                raise ModelLoadError(
                    f"draft head {path}: tensor {name} has shape {tuple(t.shape)}, but the head's "
                    f"config.json (and the target) expect {tuple(part.shape)}; the weights do not "
                    f"match config.json or were made for another target")
            part.copy_(t)


def _fill_vocab_maps(cfg: Eagle3Config, tensors: dict, path) -> None:
    """Check d2t/t2d against the target vocabulary; derive them where a head lacks them."""
    dv, v = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in tensors:
        if dv != v:
            raise ModelLoadError(f"draft head {path} has draft_vocab_size={dv} < vocab_size={v} "
                                 f"but no d2t tensor mapping draft ids to target ids")
        tensors["d2t"] = torch.zeros(dv, dtype=torch.int64)
    d2t = tensors["d2t"].to(torch.int64)
    if tuple(d2t.shape) != (dv,):
        raise ModelLoadError(f"draft head {path}: d2t has shape {tuple(d2t.shape)}, expected "
                             f"({dv},) (draft_vocab_size)")
    ids = torch.arange(dv, dtype=torch.int64) + d2t
    if dv and (int(ids.min()) < 0 or int(ids.max()) >= v):
        raise ModelLoadError(f"draft head {path}: d2t maps draft ids to target ids in "
                             f"[{int(ids.min())}, {int(ids.max())}], outside the target "
                             f"vocabulary [0, {v}); the head was made for another tokenizer")
    if "t2d" not in tensors:
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    if tuple(tensors["t2d"].shape) != (v,):
        raise ModelLoadError(f"draft head {path}: t2d has {tuple(tensors['t2d'].shape)} entries "
                             f"but the target vocabulary has {v}; the head was made for another "
                             f"tokenizer")
    tensors["d2t"], tensors["t2d"] = d2t, tensors["t2d"].to(torch.bool)


def _eagle3_config(config: dict, names, target_cfg: ModelConfig, path) -> Eagle3Config:
    L = target_cfg.num_hidden_layers
    cfg = Eagle3Config.from_hf_dict(config, L, has_embedding="embed_tokens.weight" in names)
    # The head's rope table must cover every position the target can reach.
    layer = dataclasses.replace(cfg.layer, max_position_embeddings=max(
        cfg.layer.max_position_embeddings, target_cfg.max_position_embeddings))
    cfg = dataclasses.replace(cfg, layer=layer)
    _check_attention_shape(path, cfg.layer, target_cfg)
    _same(path, "vocab_size", cfg.vocab_size, target_cfg.vocab_size,
          "the head was made for another tokenizer; use a head trained for this target")
    if not 1 <= cfg.draft_vocab_size <= cfg.vocab_size:
        raise ModelLoadError(f"draft head {path}: draft_vocab_size={cfg.draft_vocab_size} must "
                             f"be in 1..vocab_size ({cfg.vocab_size})")
    aux = cfg.resolved_aux_layer_ids
    if len(aux) != 3:
        raise ModelLoadError(f"draft head {path}: eagle_aux_hidden_state_layer_ids={list(aux)} "
                             f"must name 3 target layers (fc fuses 3 hidden states)")
    bad = [i for i in aux if not 0 <= i < L]
    if bad:
        src = "eagle_config.eagle_aux_hidden_state_layer_ids" if cfg.aux_layer_ids else \
            "the default aux layers (1, L/2-1, L-4)"
        raise ModelLoadError(
            f"draft head {path}: {src} = {list(aux)} name layer(s) {bad} outside the target's "
            f"{L} layers (0..{L - 1}); the head was trained for a deeper model, or set "
            f"eagle_config.eagle_aux_hidden_state_layer_ids in its config.json")
    return cfg


def _mtp_config(config: dict, target_cfg: ModelConfig, path) -> tuple:
    n = config.get("num_nextn_predict_layers")
    if n is None:
        raise ModelLoadError(f"draft head {path}: config.json lacks num_nextn_predict_layers "
                             f"(the number of MTP modules); it is not an MTP head config")
    if not isinstance(n, int) or n < 1:
        raise ModelLoadError(f"draft head {path}: num_nextn_predict_layers={n!r} must be an "
                             f"integer >= 1")
    def number(key, kind):
        """config.json's `key` as `kind` (the target's value where it has none)."""
        v = config.get(key, getattr(target_cfg, key))
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
        if not ok or (kind is int and not float(v).is_integer()):
            raise ModelLoadError(f"draft head {path}: config.json has {key}={v!r:.60}, not "
                                 f"{'an integer' if kind is int else 'a number'}")
        return kind(v)

    try:
        layer = dataclasses.replace(
            target_cfg, intermediate_size=number("intermediate_size", int),
            rms_norm_eps=number("rms_norm_eps", float),
            num_attention_heads=number("num_attention_heads", int),
            num_key_value_heads=number("num_key_value_heads", int),
            hidden_size=number("hidden_size", int))
        hd = config.get("head_dim") or layer.hidden_size // layer.num_attention_heads
        layer = dataclasses.replace(layer, head_dim=hd)
    except ConfigError as e:
        raise ModelLoadError(f"draft head {path}: invalid MTP config.json: {e}") from e
    _check_attention_shape(path, layer, target_cfg)
    _same(path, "vocab_size", config.get("vocab_size", target_cfg.vocab_size),
          target_cfg.vocab_size, "the head was made for another tokenizer; use a head trained "
          "for this target")
    return layer, n


def _mtp_shared_head(tensors: dict, n: int, target_cfg: ModelConfig, path) -> tuple:
    """-> (whether the modules have their own final norm, the shared_head tensor names not
    loaded). A DeepSeek-layout module has `shared_head.norm` (its norm before the LM head) and
    `shared_head.head` (a copy of the target's LM head: the target's own is used, so the head
    holds no vocabulary-sized tensor). Either every module has its norm or none does."""
    has = [f"layers.{d}.shared_head.norm.weight" in tensors for d in range(n)]
    if any(has) and not all(has):
        which = [d for d in range(n) if not has[d]]
        raise ModelLoadError(
            f"draft head {path}: layers.{has.index(True)}.shared_head.norm.weight is there but "
            f"module(s) {which} lack their shared_head.norm.weight; a head's modules all have "
            f"their own final norm or none does (the files are incomplete)")
    heads = sorted(f"layers.{d}.shared_head.head.weight" for d in range(n)
                   if f"layers.{d}.shared_head.head.weight" in tensors)
    for name in heads:
        shape = (target_cfg.vocab_size, target_cfg.hidden_size)
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(f"draft head {path}: {name} has shape "
                                 f"{tuple(tensors[name].shape)}, but the target's LM head is "
                                 f"{shape}; the head was made for another target")
    if heads:
        log.info("draft head %s: %s not loaded; the MTP modules use the target's LM head",
                 path, ", ".join(heads))
    return all(has), tuple(heads)


def _method_of(config: dict, names):
    """'eagle3' or 'mtp' when a head's files say which kind they are (its architecture, or
    tensors only that kind has), else None."""
    archs = config.get("architectures")
    arch = " ".join(str(a) for a in archs) if isinstance(archs, list) else str(archs or "")
    if "Eagle3" in arch or "d2t" in names or any(n.startswith("fc.") for n in names):
        return "eagle3"
    if config.get("num_nextn_predict_layers") or any(".eh_proj." in n for n in names):
        return "mtp"
    return None


def load_draft_head(method: str, path: Union[str, Path], target_cfg: ModelConfig,
                    first_layer_slot: int, dtype=torch.float32, device="cpu", weight_dtype=None,
                    max_positions: Optional[int] = None, tp=None, cpu_copies=None):
    """Load an EAGLE-3 (`method='eagle3'`) or MTP (`'mtp'`) head for `target_cfg`.

    Its attention layers use KV slots first_layer_slot.. (normally target_cfg.num_hidden_layers).
    `dtype` is the activation dtype; the large matrices are stored in `weight_dtype` (default:
    dtype; models/weight_dtype.py). `max_positions`: the positions its rope tables cover (the
    target's: every position the target reaches; None: the head's and the target's config).
    Raises ModelLoadError (with what to change) when the folder, config or weights are unusable
    or don't fit the target. `tp`: a tensor-parallel rank's share (None: the whole head): its
    decoder layers sharded as the target's, the rest whole (loaded whole, then cut).
    `cpu_copies`: on the CPU, the dtype of the matrices' fast copies (None: `dtype`;
    models/draft_weights.py).
    """
    if method not in DRAFT_METHODS:
        raise ConfigError(f"draft head method {method!r} is unknown; use one of "
                          f"{', '.join(DRAFT_METHODS)}")
    path = Path(path)
    config, files = _read_config(path)
    # Everything the config and the tensor names decide is checked before a weight is read:
    # the kind of head, its shapes against the target's, its rope and positions
    # (ModelConfig's checks); a head the target can't use costs no load.
    names = _tensor_names(files)
    tensors = None
    if names is None:
        tensors = _read_tensors(files)
        names = set(tensors)
    other = _method_of(config, names)
    if other is not None and other != method:
        flag = {"eagle3": "--spec eagle3 (speculative_config method 'eagle3')",
                "mtp": "--spec mtp (speculative_config method 'mtp')"}[other]
        kind = {"eagle3": "an EAGLE-3", "mtp": "an MTP"}
        raise ModelLoadError(f"draft head {path} is {kind[other]} head, not {kind[method]} "
                             f"one: use it with {flag}")
    try:
        if method == "eagle3":
            cfg = _eagle3_config(config, set(_vllm_names(names).values()), target_cfg, path)
        else:
            layer_cfg, n = _mtp_config(config, target_cfg, path)
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        # a config value of the wrong type (a string for a number, a list for an object)
        raise ModelLoadError(f"draft head {path}: invalid config.json ({type(e).__name__}: "
                             f"{e}); it is not a config outpace can build a head from") from e
    if tensors is None:
        tensors = _read_tensors(files)
    if method == "eagle3":
        renamed = _vllm_names(tensors)
        tensors = {renamed[n]: t for n, t in tensors.items()}
        _fill_vocab_maps(cfg, tensors, path)
        head = Eagle3Head(cfg, first_layer_slot, dtype=dtype, device=device,
                          max_positions=max_positions)
    known_unused = ()
    if method == "mtp":
        own_norm, known_unused = _mtp_shared_head(tensors, n, target_cfg, path)
        head = MTPHead(layer_cfg, n, first_layer_slot, dtype=dtype, device=device,
                       max_positions=max_positions, shared_head_norm=own_norm)
    _copy_weights(head, tensors, path, known_unused)
    if tp is not None and tp.size > 1:
        head = _rank_share(head, tp, lambda **kw: (
            Eagle3Head(cfg, first_layer_slot, dtype=dtype, device=device,
                       max_positions=max_positions, **kw) if method == "eagle3" else
            MTPHead(layer_cfg, n, first_layer_slot, dtype=dtype, device=device,
                    max_positions=max_positions, shared_head_norm=own_norm, **kw)))
    if weight_dtype is not None and weight_dtype != dtype:
        store_weights_in_(head, weight_dtype)
    if torch.device(device).type == "cpu":
        # the target's CPU fast paths for the head's matrices too (as the model loader does)
        add_weight_copies_(head, dtype, narrow=cpu_copies)
    return head.eval()
