"""Self-distillation data: the target answers the training prompts through outpace's own engine.

A draft head is trained to predict what the target will say, so the target writes the answers
(greedy, and optionally sampled ones too), in its chat template, batched through the engine (CUDA
graphs on a GPU). The conversations are cached as JSONL, one per line, appended as each chunk of
prompts finishes, so a resumed or repeated run regenerates nothing it already has:

    line 1:  {"outpace_selfdistill": 1, "settings": {...}}      what the answers depend on
    then:    {"id", "sample": s, "prompt_sha", "prompt_ids", "answer_ids", "finish"}

sample 0 is the greedy answer, 1.. the sampled ones (seeded by the run's seed, the prompt and the
sample, so the same settings write the same file). A cache written with other settings is an
error (delete it or choose another path), never silently mixed in.

Earlier runs' caches (`extra_answers`: another seed, so other sampled answers; plain or gzip)
add their sampled answers to a run's data: more distinct answers to the same prompts. They must
come from a target of the same shape with the same answer settings except the seed, and only
answers to the run's own prompts (same id, same text) are taken.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Optional

from outpace.errors import ConfigError
from outpace.runner_config import resolve_device

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# Prompt files may carry their text under one of these keys (MT-bench's "turns": the first).
PROMPT_KEYS = ("prompt", "turns", "question", "instruction", "text")


def read_prompts(path, limit: Optional[int] = None) -> list:
    """A JSONL prompt file -> [{"id", "prompt"}]. Each line is an object with an "id" (else its
    line number) and the text under "prompt" (or "turns": the first, "question",
    "instruction", "text"). Raises ConfigError naming the line on anything else."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"prompt file {str(p)!r} does not exist; pass a JSONL file with one "
                          f'{{"prompt": ...}} object per line')
    out, seen = [], {}
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{p}:{n} is not valid JSON ({e}); each line must be one "
                                  f"JSON object") from e
            if not isinstance(rec, dict):
                raise ConfigError(f"{p}:{n} is a JSON {type(rec).__name__}, not an object")
            text = next((rec[k] for k in PROMPT_KEYS if k in rec), None)
            if isinstance(text, list):
                text = text[0] if text else None
            if not isinstance(text, str) or not text.strip():
                raise ConfigError(f"{p}:{n} has no prompt text: give a non-empty string under "
                                  f"one of {', '.join(PROMPT_KEYS)}")
            pid = str(rec.get("id", n))
            if pid in seen:
                raise ConfigError(f"{p}:{n} repeats the id {pid!r} of line {seen[pid]}; prompt "
                                  f"ids must be unique (answers are cached by id)")
            seen[pid] = n
            out.append({"id": pid, "prompt": text})
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ConfigError(f"prompt file {p} holds no prompts")
    return out


def prompt_ids(tokenizer, text: str) -> list:
    """The token ids of one user turn in the model's chat template, ready for the answer."""
    if not getattr(tokenizer, "has_chat_template", False):
        return tokenizer.encode(text)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True)
    return tokenizer.encode(chat, add_special_tokens=False)


def _settings(target: str, cfg, max_tokens: int, temperature: float, top_p: float,
              seed: int) -> dict:
    # the number of samples is not among them: a later run asking for more samples adds
    # them to the same cache
    return {"target": str(target), "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
            "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}


def _text_key(text: str) -> str:
    """A short digest of a prompt's text: a cached answer is reused only for the same text."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _read_cache(path: Path, settings: dict) -> dict:
    """-> {(id, sample): record} of a cache written with `settings` ({} when there is none)."""
    if not path.exists():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines:
        return {}
    try:
        head = json.loads(lines[0])
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("outpace_selfdistill") != FORMAT_VERSION:
        raise ConfigError(f"{path} is not an outpace self-distillation cache; delete it or pass "
                          f"another --data-cache")
    old = head.get("settings", {})
    diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
    if diff:
        what = ", ".join(f"{k}: {old.get(k)!r} there, {settings.get(k)!r} now" for k in diff[:4])
        raise ConfigError(f"{path} holds answers generated with other settings ({what}); "
                          f"delete it to regenerate, or pass another --data-cache")
    records = {}
    for n, line in enumerate(lines[1:], 2):
        try:
            rec = json.loads(line)
        except ValueError:
            if n == len(lines):  # a run stopped mid-write: that record is generated again
                log.warning("%s: ignoring a truncated last line", path)
                continue
            raise ConfigError(f"{path}:{n} is not valid JSON; the cache is damaged: delete it "
                              f"to regenerate") from None
        records[(rec["id"], rec["sample"])] = rec
    return records


# the settings an extra cache may differ in: its seed (the reason to add it) and the target's
# path (the same model file elsewhere)
_EXTRA_MAY_DIFFER = ("seed", "target")


def read_extra_answers(paths, prompts: list, cfg, max_tokens: int, temperature: float,
                       top_p: float, seed: int) -> list:
    """The sampled answers (sample >= 1) of earlier runs' caches `paths` to `prompts` (same id
    and text), for a target shaped as `cfg` -> records, in the order of the files and their
    lines. A file that is not a cache, was written with other settings, or with this run's own
    seed (its answers would repeat the run's) is an error naming it."""
    want = {k: v for k, v in _settings("", cfg, max_tokens, temperature, top_p, seed).items()
            if k not in _EXTRA_MAY_DIFFER}
    keys = {p["id"]: _text_key(p["prompt"]) for p in prompts}
    out = []
    for path in paths:
        path = Path(path).expanduser()
        if not path.is_file():
            raise ConfigError(f"--extra-answers {path}: no such file")
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rt", encoding="utf-8") as f:
                head = _extra_head(path, f.readline())
                old = head.get("settings", {})
                diff = sorted(k for k in want if old.get(k) != want[k])
                if diff:
                    what = ", ".join(f"{k}: {old.get(k)!r} there, {want[k]!r} now"
                                     for k in diff[:4])
                    raise ConfigError(f"--extra-answers {path} was generated with other "
                                      f"settings ({what})")
                if old.get("seed") == seed:
                    raise ConfigError(f"--extra-answers {path} has this run's seed ({seed}): "
                                      f"its sampled answers are the ones this run generates")
                for n, line in enumerate(f, 2):
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        raise ConfigError(f"--extra-answers {path}:{n} is not valid JSON") \
                            from None
                    if (isinstance(rec, dict) and rec.get("sample", 0) >= 1
                            and keys.get(rec.get("id")) == rec.get("prompt_sha")):
                        out.append(rec)
        except (OSError, EOFError, UnicodeDecodeError) as e:  # a damaged gzip stream
            raise ConfigError(f"--extra-answers {path} can't be read: {e}") from None
    return out


def _extra_head(path: Path, line: str) -> dict:
    try:
        head = json.loads(line)
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("outpace_selfdistill") != FORMAT_VERSION:
        raise ConfigError(f"--extra-answers {path} is not an outpace self-distillation cache")
    return head


def regenerate(target: str, prompts: list, cache: Path, *, loaded=None, device: str = "auto",
               max_tokens: int = 512, samples: int = 0, temperature: float = 0.8,
               top_p: float = 0.95, seed: int = 0, max_num_seqs: Optional[int] = None,
               quiet: bool = False) -> list:
    """The target's answers to `prompts` ([{"id", "prompt"}]): the greedy one and `samples`
    sampled ones each, from the cache where it has them, else generated and appended to it.
    -> records in prompt order (sample 0, 1, ... per prompt)."""
    from outpace.engine.engine import LLMEngine
    from outpace.models.loader import load_model
    from outpace.types import SamplingParams
    import torch
    if max_tokens < 1:
        raise ConfigError(f"answer max_tokens must be >= 1, got {max_tokens}")
    if samples < 0:
        raise ConfigError(f"sampled answers per prompt must be >= 0, got {samples}")
    device = resolve_device(device)
    if loaded is None:
        loaded = load_model(target, dtype=torch.bfloat16 if device.startswith("cuda")
                            else torch.float32, device=torch.device(device), quiet=quiet)
    model, cfg, tok = loaded
    settings = _settings(target, cfg, max_tokens, temperature, top_p, seed)
    cache = Path(cache)
    have = _read_cache(cache, settings)
    wanted = [(p, s) for p in prompts for s in range(samples + 1)]

    def cached(p, s):
        r = have.get((p["id"], s))
        return r is not None and r.get("prompt_sha") == _text_key(p["prompt"])

    todo = [(p, s) for p, s in wanted if not cached(p, s)]
    if todo:
        cache.parent.mkdir(parents=True, exist_ok=True)
        if not cache.exists() or cache.stat().st_size == 0:
            cache.write_text(json.dumps({"outpace_selfdistill": FORMAT_VERSION,
                                         "settings": settings}) + "\n", encoding="utf-8")
        limit = min(cfg.max_position_embeddings, 1 << 20)
        jobs, skipped = [], 0
        for p, s in todo:
            ids = prompt_ids(tok, p["prompt"])
            if len(ids) + max_tokens > limit:
                skipped += 1
                continue
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0) if s == 0 \
                else SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                    top_p=top_p, seed=_sample_seed(seed, p["id"], s))
            jobs.append((p, s, ids, params))
        seqs = max_num_seqs or (128 if device.startswith("cuda") else 16)
        block = 16
        longest = max((len(j[2]) for j in jobs), default=1) + max_tokens
        engine = LLMEngine.from_args(target, loaded=loaded, device=device, max_num_seqs=seqs,
                                     num_kv_blocks=seqs * (-(-longest // block) + 1) + 64,
                                     max_model_len=longest, block_size=block, seed=seed,
                                     quiet=True)
        from tqdm import tqdm
        bar = tqdm(total=len(jobs), desc="Self-distilling answers", unit="answer",
                   file=sys.stderr, disable=quiet, dynamic_ncols=True,
                   mininterval=0.2 if sys.stderr.isatty() else 15)
        try:
            with open(cache, "a", encoding="utf-8") as f:
                for n, rec in enumerate(_generate(engine, jobs, seqs)):
                    f.write(json.dumps(rec) + "\n")
                    have[(rec["id"], rec["sample"])] = rec
                    bar.update(1)
                    if n % 256 == 255:
                        f.flush()
        finally:
            bar.close()
            del engine
        if skipped and not quiet:
            print(f"outpace: skipped {skipped} prompt(s) longer than the context allows with "
                  f"{max_tokens} answer tokens", file=sys.stderr)
    return [have[(p["id"], s)] for p, s in wanted if cached(p, s)]


def _sample_seed(seed: int, pid: str, sample: int) -> int:
    h = hashlib.sha256(f"{seed}\t{pid}\t{sample}".encode()).digest()
    return int.from_bytes(h[:4], "little")


def _generate(engine, jobs: list, window: int):
    """Run jobs ([(prompt, sample, ids, params)]) through the engine, at most `window` in it at
    a time; yields each record as its answer finishes. New requests join in groups, once an
    eighth of the window is free: a step that admits a prompt runs beside the decodes as a
    mixed (varlen) step, so admitting them one by one would make nearly every step one."""
    import dataclasses
    live, nxt = {}, 0
    group = max(1, window // 8)
    try:
        while nxt < len(jobs) or live:
            if not live or len(live) <= window - group:  # a group's worth of free slots
                while nxt < len(jobs) and len(live) < window:
                    p, s, ids, params = jobs[nxt]
                    key = f"sd-{nxt}"
                    engine.add_request(key, ids,
                                       dataclasses.replace(params, output_kind="final_only"))
                    live[key] = jobs[nxt]
                    nxt += 1
            for out in engine.step():
                if out.finished:
                    p, s, ids, _ = live.pop(out.request_id)
                    yield {"id": p["id"], "sample": s, "prompt_sha": _text_key(p["prompt"]),
                           "prompt_ids": list(ids), "answer_ids": list(out.token_ids),
                           "finish": out.finish_reason}
    finally:
        for key in live:  # leave nothing half-run in the engine
            engine.abort_request(key)
