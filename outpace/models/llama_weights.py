"""A Llama-family model's weights: checkpoint names -> its fused parameters (`param_slices`),
the copy from a checkpoint's tensors (`load_weights`, with each tensor-parallel rank's part of
the sharded ones), and a draft head layer's share of a whole one (`layer_part_from_`)."""

from __future__ import annotations

from typing import Iterable

import torch

from outpace.errors import ModelLoadError


@torch.no_grad()
def layer_part_from_(layer, whole) -> None:
    """This rank's share (layer's tp) of an unsharded layer's weights: a draft head's layer,
    loaded whole first (it is one layer)."""
    a, w, m, wm = layer.self_attn, whole.self_attn, layer.mlp, whole.mlp
    q0, kv0 = a.tp.rank * a.q_size, a.kv_head_start * a.head_dim

    def qkv(dst, src):
        dst[:a.q_size].copy_(src[q0:q0 + a.q_size])
        for i in (1, 2):  # k, then v
            at, src_at = a.q_size + (i - 1) * a.kv_size, w.q_size + (i - 1) * w.kv_size
            dst[at:at + a.kv_size].copy_(src[src_at + kv0:src_at + kv0 + a.kv_size])
    qkv(a.qkv_weight, w.qkv_weight)
    if a.qkv_bias is not None:
        qkv(a.qkv_bias, w.qkv_bias)
    a.o_weight.copy_(w.o_weight[:, q0:q0 + a.q_size])
    i0 = m.tp.rank * m.inter
    m.gate_up_weight[:m.inter].copy_(wm.gate_up_weight[i0:i0 + m.inter])
    m.gate_up_weight[m.inter:].copy_(wm.gate_up_weight[wm.inter + i0:wm.inter + i0 + m.inter])
    m.down_weight.copy_(wm.down_weight[:, i0:i0 + m.inter])
    for mine, theirs in ((layer.input_layernorm, whole.input_layernorm),
                         (layer.post_attention_layernorm, whole.post_attention_layernorm),
                         (a.q_norm, w.q_norm), (a.k_norm, w.k_norm)):
        if mine is not None:
            mine.weight.copy_(theirs.weight)
    if a.o_bias is not None:
        a.o_bias.copy_(w.o_bias)


def param_slices(model) -> dict:
    """HF parameter name -> (destination Parameter, first row, rows, source dim, source
    start, source length) for load_weights: the checkpoint tensor (of that length along
    `source dim`; None: taken whole) is narrowed to this rank's part from `source start`
    and copied into the destination's rows."""
    cfg, tp, r = model.config, model.tp, model.tp.rank
    sharded = tp.size > 1
    whole = lambda dest, off=0, rows=None: (dest, off, dest.shape[0] if rows is None
                                            else rows, None, 0, None)

    def part(dest, off, rows, dim, start, full):
        return (dest, off, rows, dim, start, full) if sharded else whole(dest, off, rows)
    vocab = part(model.embed_weight, 0, model.vocab_held, 0, model.vocab_start, cfg.vocab_size)
    out = {"model.embed_tokens.weight": vocab, "model.norm.weight": whole(model.norm.weight)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = part(model.lm_head_weight, 0, model.vocab_held, 0,
                                     model.vocab_start, cfg.vocab_size)
    hd = cfg.head_dim
    q_full, kv_full = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    for i, layer in enumerate(model.layers):
        p, a, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
        out[p + "input_layernorm.weight"] = whole(layer.input_layernorm.weight)
        out[p + "post_attention_layernorm.weight"] = whole(layer.post_attention_layernorm.weight)
        kv0 = a.kv_head_start * hd
        offs = {"q": (0, a.q_size, r * a.q_size, q_full),
                "k": (a.q_size, a.kv_size, kv0, kv_full),
                "v": (a.q_size + a.kv_size, a.kv_size, kv0, kv_full)}
        for n, (off, rows, start, full) in offs.items():
            out[f"{p}self_attn.{n}_proj.weight"] = part(a.qkv_weight, off, rows, 0, start,
                                                        full)
            if a.qkv_bias is not None:
                out[f"{p}self_attn.{n}_proj.bias"] = part(a.qkv_bias, off, rows, 0, start,
                                                          full)
        out[p + "self_attn.o_proj.weight"] = part(a.o_weight, 0, cfg.hidden_size, 1,
                                                  r * a.q_size, q_full)
        if a.o_bias is not None:
            out[p + "self_attn.o_proj.bias"] = whole(a.o_bias)
        if a.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = whole(a.q_norm.weight)
            out[p + "self_attn.k_norm.weight"] = whole(a.k_norm.weight)
        inter = cfg.intermediate_size
        out[p + "mlp.gate_proj.weight"] = part(mlp.gate_up_weight, 0, mlp.inter, 0,
                                               r * mlp.inter, inter)
        out[p + "mlp.up_proj.weight"] = part(mlp.gate_up_weight, mlp.inter, mlp.inter, 0,
                                             r * mlp.inter, inter)
        out[p + "mlp.down_proj.weight"] = part(mlp.down_weight, 0, cfg.hidden_size, 1,
                                               r * mlp.inter, inter)
    return out


@torch.no_grad()
def load_weights(model, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Copy HF-named tensors into the (fused) parameters; returns the names it did not use.
    A tensor may also be an object with `shape` and `copy_into(target)` (a GGUF tensor
    dequantized straight into its parameter).

    Raises ModelLoadError on a shape mismatch or when a parameter got no tensor.
    """
    slots = param_slices(model)
    missing, unused = set(slots), []
    for name, tensor in weights:
        if name not in slots:
            if not name.endswith("rotary_emb.inv_freq"):  # HF buffer, recomputed here
                unused.append(name)
            continue
        dest, off, rows, dim, start, full = slots[name]
        target = dest.narrow(0, off, rows)
        expected = list(target.shape)
        if dim is not None:
            expected[dim] = full
        if tuple(expected) != tuple(tensor.shape):
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(tensor.shape)}, but the model config "
                f"expects {tuple(expected)}; the weights do not match config.json")
        if dim is not None:  # this rank's part of it: a tensor's slice, or what a loader's
            # tensor reads of it (safetensors.StoredTensor, gguf_quants.QuantizedTensor)
            target.copy_(tensor.narrow(dim, start, target.shape[dim])
                         if isinstance(tensor, torch.Tensor)
                         else tensor.part(dim, start, target.shape[dim]))
        elif isinstance(tensor, torch.Tensor):
            target.copy_(tensor)
        else:  # a loader's tensor that writes itself (loader/gguf_quants.QuantizedTensor)
            tensor.copy_into(target)
        missing.discard(name)
    if missing:
        names = sorted(missing)
        raise ModelLoadError(
            f"the checkpoint lacks {len(names)} tensor(s) the model needs, e.g. "
            f"{', '.join(names[:4])}; the files are incomplete or for another architecture")
    return unused
