"""Helpers for the speculative-decoding engine tests: a tiny peaked target, dense references,
repetitive prompts and runs that record what happened (drafts, preemptions, cache hits)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from outpace.attention.base import AttentionMetadata, ForwardContext
from outpace.attention.torch_ref import TorchRefBackend
from outpace.model_config import ModelConfig
from outpace.models.draft_loader import model_config_dict
from outpace.models.llama import LlamaForCausalLM
from outpace.speculative.base import DraftBatch
from tests.engine_helpers import make_engine

# A draft head's matrices read in fp32 (SpecConfig.draft_weight_dtype): the tests that compare
# its draft plane, hidden states or drafts with fp32 oracles or across paths (on a CPU with bf16
# instructions the default reads them as bf16, whose rounding depends on a launch's shape).
EXACT_DRAFTS = {"draft_weight_dtype": "float32"}
TINY_VOCAB = 96
TINY_LAYERS = 4  # EAGLE-3 aux layers (1, 1, 0): clamped defaults of a shallow target
TINY_BLOCK = 4  # small blocks: many block boundaries, prefix hits and lookahead edges
# A greedy token whose top-1/top-2 logit gap is below this could flip between batch shapes
# (fp32 rounding differs per shape, ~1e-6); references are checked to stay well above it.
MIN_MARGIN = 1e-3


class TinyTokenizer:
    """Enough of outpace.tokenizer.Tokenizer for the engine: ids <-> one character each."""

    eos_token_ids: tuple = ()
    has_chat_template = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        return [ord(c) % TINY_VOCAB for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(48 + int(i) % 64) for i in ids)


def tiny_config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=TINY_VOCAB, hidden_size=64,
                       intermediate_size=96, num_hidden_layers=TINY_LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512)


def tiny_target(seed: int = 1, std: float = 0.08, lm_head_std: float = 1.0):
    """(model, cfg, tokenizer) with random weights. The small layer std makes greedy outputs
    fall into loops (n-gram/suffix drafts get accepted: mean acceptance ~2 at k=3); the large LM
    head std gives logits of std ~8, so greedy winners are clear. This seed's references keep a
    top-1/top-2 gap >= MIN_MARGIN on the test prompts (checked by the tests)."""
    cfg = tiny_config()
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name == "lm_head_weight":
                p.copy_(lm_head_std * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model.eval(), cfg, TinyTokenizer()


def write_target_folder(cfg: ModelConfig, folder: Path) -> Path:
    """A target folder as init_draft reads it (only config.json is needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model_config_dict(cfg)))
    return folder


def head_spec(heads: dict, method: str, k: int = 3) -> dict:
    """A speculative_config for one of the random heads (tiny_heads): EAGLE-3, or MTP run as a
    chain. Random heads propose junk, so the suffix enhancer's matches (min 2) carry the
    acceptance a test needs."""
    cfg = {"method": method, "model": str(heads[method]), "num_speculative_tokens": k,
           "enhancer_min_match": 2}
    if method == "mtp":
        cfg["mtp_mode"] = "eagle"
    return cfg


def write_prompt_file(path: Path, n: int, max_chars: int, seed: int = 0) -> Path:
    """A train-draft prompt file (JSONL, {"id", "prompt"}) of n short random texts over the
    tiny tokenizer's letters."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(6, max_chars)))
            f.write(json.dumps({"id": f"p{i}", "prompt": text}) + "\n")
    return path


def random_tokens(rng: random.Random, length: int, vocab: int) -> list:
    return [rng.randrange(vocab) for _ in range(length)]


def repetitive_prompts(n: int, seed: int, prefix=(), period: int = 6, repeats: int = 3) -> list:
    """Prompts of a short random motif repeated (copy-friendly), then a few random tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(TINY_VOCAB) for _ in range(period)]
        out.append(list(prefix) + motif * repeats + [rng.randrange(TINY_VOCAB)
                                                     for _ in range(i % 4)])
    return out


# ---- dense references (one sequence, a fresh KV pool, no batching) ---------------------------


def dense_ctx(kv: torch.Tensor, n: int, cfg: ModelConfig) -> ForwardContext:
    """A one-sequence context over pool `kv` with positions 0..n-1 in blocks 1, 2, ..."""
    bs = kv.shape[3]
    nb = (n + bs - 1) // bs
    backend = TorchRefBackend(kv, cfg.num_attention_heads, cfg.num_key_value_heads,
                              cfg.head_dim, cfg.head_dim ** -0.5)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(bs, bs + n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(1, nb + 1, dtype=torch.int32).unsqueeze(0),
        query_start_loc_host=[0, n], seq_lens_host=[n], max_query_len=n, max_seq_len=n)
    return ForwardContext(backend, meta)


@torch.inference_mode()
def dense_target(model, cfg, ids: list, capture=()):
    """-> (hidden [n, H], aux list of [n, H], logits [n, V]) of one dense causal forward."""
    n = len(ids)
    kv = torch.zeros(cfg.num_hidden_layers, 2, n // TINY_BLOCK + 2, TINY_BLOCK,
                     cfg.num_key_value_heads, cfg.head_dim)
    hidden, aux = model(torch.tensor(ids), torch.arange(n), dense_ctx(kv, n, cfg),
                        capture_layers=tuple(capture))
    return hidden, aux, model.compute_logits(hidden)


def min_greedy_margin(model, cfg, sequences: list, prompt_lens: list) -> float:
    """Smallest top-1/top-2 logit gap over the generated positions of greedy sequences (and a
    check that each generated token is the dense argmax: the reference itself is right)."""
    worst = float("inf")
    for seq, n in zip(sequences, prompt_lens):
        _, _, logits = dense_target(model, cfg, seq[:-1])
        rows = logits[n - 1:]
        top = rows.topk(2, dim=-1)
        assert top.indices[:, 0].tolist() == seq[n:], "reference is not the dense greedy output"
        worst = min(worst, float((top.values[:, 0] - top.values[:, 1]).min()))
    return worst


@torch.inference_mode()
def dense_draft_plane(proposer, model, cfg, ids: list) -> torch.Tensor:
    """[2, n-1, Hkv, D]: the draft-plane K/V a head should hold at positions 0..n-2 of `ids`,
    computed from scratch: target hiddens of one dense forward, head input token = ids[p+1]."""
    n = len(ids)
    hidden, aux, _ = dense_target(model, cfg, ids, proposer.capture_layers)
    slot = cfg.num_hidden_layers
    kv = torch.zeros(slot + proposer.num_kv_layers, 2, n // TINY_BLOCK + 2, TINY_BLOCK,
                     cfg.num_key_value_heads, cfg.head_dim)
    m = n - 1
    batch = DraftBatch(requests=[], committed=[], row_start=[], row_end=[], last_row=[],
                       hidden=hidden[:m], aux_hidden=[a[:m] for a in aux])
    proposer.step(proposer.first_hidden(batch), torch.tensor(ids[1:]), torch.arange(m),
                  dense_ctx(kv, m, cfg))
    flat = kv[slot].flatten(1, 2)  # [2, blocks * bs, Hkv, D]
    return flat[:, TINY_BLOCK:TINY_BLOCK + m].clone()


def engine_draft_plane(engine, request_id: str, num_positions: int) -> torch.Tensor:
    """[2, num_positions, Hkv, D] draft-plane K/V of a request, read through its block table."""
    kv = engine.runner.kv_cache
    slot = engine.config.model_config.num_hidden_layers
    bs = kv.shape[3]
    table = engine.kv.block_ids(request_id)
    pos = torch.arange(num_positions)
    blocks = torch.tensor(table, dtype=torch.long)[pos // bs]
    return kv[slot][:, blocks, pos % bs].clone()


# ---- runs -------------------------------------------------------------------------------------


@dataclass
class Run:
    outputs: list  # token ids per prompt, in prompt order (all waves)
    engine: object
    stats: dict = field(default_factory=dict)
    outs: list = field(default_factory=list)  # RequestOutput per prompt (finished)


def run_waves(loaded, waves: list, params, after_step=None, on_engine=None,
              **engine_kwargs) -> Run:
    """Run each wave of prompts to completion in one engine (later waves hit the prefix cache
    of earlier ones). params: SamplingParams, or a list per prompt over all waves.
    on_engine(engine) runs once before the first request; after_step(engine) after every step."""
    eng = make_engine(loaded, **engine_kwargs)
    if on_engine is not None:
        on_engine(eng)
    outs = []
    at = 0
    for w, prompts in enumerate(waves):
        rids = [f"w{w}-{i}" for i in range(len(prompts))]
        for rid, p in zip(rids, prompts):
            eng.add_request(rid, p, params[at] if isinstance(params, list) else params)
            at += 1
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
            if after_step is not None:
                after_step(eng)
        outs += [done[r] for r in rids]
    return Run(outputs=[o.token_ids for o in outs], engine=eng, stats=eng.stats(), outs=outs)


def first_divergence(model, cfg, prompt: list, want: list, got: list) -> str:
    """Where two greedy outputs part, with the reference's top-1/top-2 gap there (a tiny gap
    means a near-tie that batch-shape rounding may flip; a large one means a real bug)."""
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    _, _, logits = dense_target(model, cfg, prompt + want[:i])
    top = logits[-1].topk(2)
    return (f"outputs differ at token {i}: want {want[i:i + 5]}, got {got[i:i + 5]}; dense "
            f"top-2 there {top.indices.tolist()} gap {float(top.values[0] - top.values[1]):.2e}")


@torch.inference_mode()
def dense_chain(proposer, model, cfg, ids: list, k: int):
    """The head's draft chain for committed `ids`, recomputed from scratch in a fresh pool that
    holds only exact entries: first pass over positions 0..f-2 (target hiddens, next tokens),
    then chain step j at position f-2+j. -> (hiddens [k, H] fed to draft_ids, tokens [k])."""
    f = len(ids)
    hidden, aux, _ = dense_target(model, cfg, ids, proposer.capture_layers)
    slot = cfg.num_hidden_layers
    kv = torch.zeros(slot + proposer.num_kv_layers, 2, (f + k) // TINY_BLOCK + 2, TINY_BLOCK,
                     cfg.num_key_value_heads, cfg.head_dim)
    m = f - 1
    batch = DraftBatch(requests=[], committed=[], row_start=[], row_end=[], last_row=[],
                       hidden=hidden[:m], aux_hidden=[a[:m] for a in aux])
    h = proposer.step(proposer.first_hidden(batch), torch.tensor(ids[1:]), torch.arange(m),
                      dense_ctx(kv, m, cfg))[m - 1:m]  # [1, H] at position f-2
    hs, toks = [h], [proposer.draft_ids(h)]
    for j in range(1, k):
        ctx = dense_ctx(kv, m + j, cfg)  # seq_len f-1+j: the one new row at position f-2+j
        meta = ctx.meta
        meta.slot_mapping = meta.slot_mapping[-1:]
        meta.query_start_loc = torch.tensor([0, 1], dtype=torch.int32)
        meta.query_start_loc_host = [0, 1]
        meta.max_query_len = 1
        h = proposer.step(h, toks[-1], torch.tensor([m - 1 + j]), ctx)
        hs.append(h)
        toks.append(proposer.draft_ids(h))
    return torch.cat(hs), torch.cat(toks)


class ChainRecorder:
    """Wraps a head proposer's propose/draft_ids: records, per propose call, the batch, the k
    list and every hidden fed to draft_ids, so a test can compare each request's chain with
    dense_chain. Mapping rows to requests mirrors HeadProposer.propose: step j's rows are the
    requests (in batch order) with last_row >= 0 and k > j."""

    def __init__(self, proposer):
        self.calls = []  # (committed per request, k list, last_row list, [hidden per step])
        self._inside = False  # only draft_ids calls made by propose are recorded
        inner_propose, inner_ids = proposer.propose, proposer.draft_ids

        def draft_ids(h):
            toks = inner_ids(h)
            if self._inside:
                self.calls[-1][3].append((h.clone(), toks.clone()))
            return toks

        def propose(batch, k):
            self.calls.append(([list(c) for c in batch.committed], list(k),
                               list(batch.last_row), []))
            self._inside = True
            try:
                return inner_propose(batch, k)
            finally:
                self._inside = False

        proposer.propose, proposer.draft_ids = propose, draft_ids

    def chains(self):
        """Yield (committed ids, k, hiddens [k, H], tokens [k]) per drafted request and call."""
        for committed, k, last_row, steps in self.calls:
            rows = {}
            for j, (h, toks) in enumerate(steps):
                active = [i for i, ki in enumerate(k) if ki > j and last_row[i] >= 0]
                assert len(active) == h.shape[0], "draft_ids calls don't match the k list"
                for n, i in enumerate(active):
                    rows.setdefault(i, []).append((h[n], toks[n]))
            for i, seq in rows.items():
                yield (committed[i], k[i], torch.stack([s[0] for s in seq]),
                       torch.stack([s[1] for s in seq]))
