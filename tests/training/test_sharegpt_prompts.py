"""benchmarks/sharegpt_prompts.py: the larger training prompt file keeps the shipped file's prompts
first and unchanged (earlier runs' cached answers match them by id and text), adds the other
user turns that pass the shipped file's filters once each, never an evaluation prompt, and reads
a JSON array cut off mid-record as the package's is."""

from __future__ import annotations

import json

from benchmarks.sharegpt_prompts import BASE, build, eval_texts, read_conversations


def conv(cid, *human):
    turns = []
    for text in human:
        turns += [{"from": "human", "value": text}, {"from": "gpt", "value": "sure"}]
    return {"id": cid, "conversations": turns}


def test_base_first_then_new_first_turns_then_later_turns_filtered_and_once(tmp_path):
    base = [json.loads(line) for line in BASE.read_text(encoding="utf-8").splitlines()]
    mt_turn = next(iter(t for t in eval_texts() if len(t) > 40))
    long_ok = "Explain how a hash map handles collisions, with an example in Python."
    convs = [conv("new1_0", "Write a haiku about the sea, please.", long_ok, "continue"),
             conv(base[0]["id"], base[0]["prompt"],
                  "Now make it shorter and funnier for my kids, please."),
             conv("new2_0", "short", mt_turn, long_ok),          # too short, eval, repeat
             conv("new3_0", "\u4f60\u597d" * 30),                 # not ASCII
             conv("new4_0", "x" * 2001)]                          # too long
    rows = build(convs)
    assert rows[:len(base)] == base
    new = rows[len(base):]
    assert new[0] == {"id": "new1_0", "prompt": "Write a haiku about the sea, please."}
    assert sorted((r["id"], r["prompt"]) for r in new[1:]) == sorted([
        ("new1_0:2", long_ok),
        (f"{base[0]['id']}:2", "Now make it shorter and funnier for my kids, please.")])
    assert len({r["id"] for r in rows}) == len(rows)


def test_a_json_array_cut_mid_record_gives_its_whole_records(tmp_path):
    whole = [conv("a_0", "first prompt here"), conv("b_0", "second prompt here")]
    text = json.dumps(whole)
    cut = tmp_path / "cut.json"
    cut.write_text(text[:-15], encoding="utf-8")  # inside the last record
    assert read_conversations(cut) == whole[:1]
    full = tmp_path / "full.json"
    full.write_text(text, encoding="utf-8")
    assert read_conversations(full) == whole
