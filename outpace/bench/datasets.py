"""Benchmark prompts: random ones of a given length, or a dataset file's.

A dataset file is JSONL, one object a line, or a JSON array of such objects (ShareGPT's own
files are arrays). An object gives its prompt as `"prompt": TEXT` (benchmarks/prompts/*.jsonl),
or as a conversation: ShareGPT's `"conversations": [{"from": "human", "value": TEXT}, ...]` or
OpenAI's `"messages": [{"role": "user", "content": TEXT}, ...]`, whose first human / user turn is
the prompt. A conversation without such a turn is skipped (ShareGPT holds some); an object of
neither shape is an error naming its line (entry)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

from outpace.errors import ConfigError

# random text for a server: common English words, about one token each in BPE vocabularies
WORDS = ("the of and to in is was for on are as with his they at be this from have or by one "
         "had not but what all were when we there can an your which their said if do will each "
         "about how up out them then she many some so these would other into has more her two "
         "like him see time could no make than first been its who now people my made over did "
         "down only way find use may water long little very after words called just where most "
         "know get through back much before go good new write our used me man too any day same "
         "right look think also around another came come work three word must because does "
         "part even place well such here take why things help put years different away again "
         "off went old number great tell men say small every found still between name should "
         "home big give air line set own under read last never us left end along while might "
         "next sound below saw something thought both few those always looked show large often "
         "together asked house don world going want school important until form food keep "
         "children feet land side without boy once animals life enough took sometimes four head "
         "above kind began almost live page got earth need far hand high year mother light "
         "parts country father let night following picture being study second eyes soon times "
         "story boys since white days ever paper hard near sentence better best across during "
         "today others however sure means knew try told young miles sun ways thing whole hear "
         "example heard several change answer room sea against top turned learn point city play "
         "toward five using himself usually").split()


def random_token_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list:
    """`num` prompts of `input_len` token ids drawn uniformly below vocab_size (vLLM's random
    prompts for the offline benchmarks)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num)]


def random_text_prompts(num: int, input_len: int, seed: int) -> list:
    """`num` prompts of `input_len` random common words (for a server, which takes text: about
    input_len tokens in most tokenizers; the server's usage counts them exactly)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(input_len)) for _ in range(num)]


def load_dataset(path: str, limit: Optional[int] = None, flag: str = "--dataset") -> list:
    """The prompts of a dataset file (see the module's docstring), in file order; at most
    `limit` of them (JSONL is read no further). Errors name `flag` and the line or entry."""
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a folder" if p.is_dir() else "does not exist"
        raise ConfigError(f"{flag} {path!r} {what}; give a JSONL file of {{\"prompt\": ...}} "
                          f"objects or a ShareGPT JSON file", option="dataset")
    prompts: list = []
    with open(p, encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 12).lstrip()
        f.seek(0)
        if head.startswith("["):
            try:
                entries = json.load(f)
            except (ValueError, RecursionError) as e:
                raise ConfigError(f"{flag} {path!r} is not valid JSON: {e}",
                                  option="dataset") from None
            for i, entry in enumerate(entries):
                _add(prompts, entry, f"{flag} {path!r} entry {i}")
                if limit is not None and len(prompts) >= limit:
                    break
        else:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{flag} {path!r} line {n}"
                try:
                    entry = json.loads(line)
                except (ValueError, RecursionError) as e:
                    raise ConfigError(f"{where} is not JSON: {e}", option="dataset") from None
                _add(prompts, entry, where)
                if limit is not None and len(prompts) >= limit:
                    break
    if not prompts:
        raise ConfigError(f"{flag} {path!r} holds no prompts", option="dataset")
    return prompts


def _add(prompts: list, entry, where: str) -> None:
    if isinstance(entry, dict) and isinstance(entry.get("prompt"), str):
        if entry["prompt"]:
            prompts.append(entry["prompt"])
        return
    turns = entry.get("conversations", entry.get("messages")) if isinstance(entry, dict) \
        else None
    if not isinstance(turns, list):
        raise ConfigError(f"{where} has no \"prompt\" string, ShareGPT \"conversations\" or "
                          f"\"messages\" list", option="dataset")
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        who = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if who in ("human", "user") and isinstance(text, str) and text:
            prompts.append(text)
            return


def cycle(items: list, num: int) -> list:
    """`num` items: `items` in order, repeated as often as needed."""
    return [items[i % len(items)] for i in range(num)]
