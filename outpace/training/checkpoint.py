"""Training checkpoints: everything a run needs to continue exactly where it stopped.

    <out>/checkpoints/step_0000500/
        head.safetensors   the head's fp32 master weights and buffers (d2t, t2d)
        optimizer.pt       AdamW's state
        state.json         step, planned steps, warm-up, the trajectory options, the data digest
    <out>/checkpoints/latest   the name of the newest complete checkpoint

A checkpoint is written into a temporary folder and renamed when complete, and `latest` is
replaced atomically after it, so a run killed mid-save leaves the previous checkpoint intact.
The batches' order is a function of (seed, epoch), so the step count places a resumed run in
its data exactly.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from outpace.errors import ConfigError

LATEST = "latest"


def save_checkpoint(ckpt_dir: Path, step: int, head, optimizer, state: dict,
                    keep: int) -> Path:
    from safetensors.torch import save_file
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:07d}"
    final = ckpt_dir / name
    tmp = ckpt_dir / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()},
              str(tmp / "head.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = ckpt_dir / f".{LATEST}.tmp"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, ckpt_dir / LATEST)
    olds = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir() and p.name != name)
    for old in olds[:max(0, len(olds) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find_checkpoint(path) -> Path:
    """A checkpoint folder, or a training out folder / its checkpoints folder (-> the latest)."""
    p = Path(path).expanduser()
    if (p / "state.json").is_file():
        return p
    for d in (p / "checkpoints", p):
        latest = d / LATEST
        if latest.is_file():
            c = d / latest.read_text().strip()
            if (c / "state.json").is_file():
                return c
    raise ConfigError(f"--resume {str(p)!r} is not a checkpoint: pass a checkpoints/step_* "
                      f"folder, or the --out folder of an earlier train-draft run")


def load_checkpoint(path, head, optimizer) -> dict:
    """Load the head's weights and the optimizer's state from a checkpoint -> its state.json."""
    from safetensors.torch import load_file
    c = find_checkpoint(path)
    try:
        state = json.loads((c / "state.json").read_text())
        tensors = load_file(str(c / "head.safetensors"))
        opt = torch.load(c / "optimizer.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged or partial checkpoint: say which
        raise ConfigError(f"can't read checkpoint {c}: {e}") from e
    own = head.state_dict()
    if set(own) != set(tensors) or any(own[k].shape != tensors[k].shape for k in own):
        raise ConfigError(f"checkpoint {c} holds a head of another shape; resume with the "
                          f"options it was trained with")
    head.load_state_dict(tensors)
    optimizer.load_state_dict(opt)
    state["path"] = str(c)
    return state
