"""Load a Hugging Face model folder: config.json + *.safetensors (single file or sharded).

torch is imported by the loading functions only: config.json reads without it, so that the
engine's arguments are checked against the config before torch loads (engine/preflight.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from outpace.errors import ConfigError, ModelLoadError, UnsupportedModelError
from outpace.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

_INDEX = "model.safetensors.index.json"


def read_hf_config(folder) -> ModelConfig:
    """ModelConfig from `folder/config.json`, with errors that say what is wrong."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{folder} has no config.json; pass a Hugging Face model folder (config.json, "
            "*.safetensors, tokenizer files) or a .gguf file")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"can't parse {path}: {e}; fix or re-download it") from e
    except RecursionError:
        raise ModelLoadError(f"{path} nests too deeply to be a model config; fix or "
                             f"re-download it") from None
    if not isinstance(d, dict):
        raise ModelLoadError(f"{path} is not a JSON object; fix or re-download it")
    try:
        return ModelConfig.from_hf_dict(d)
    except UnsupportedModelError:
        raise
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}; it does not describe a model outpace can build") from e
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        raise ModelLoadError(f"{path} is missing or has a bad value for {e}; "
                             "it does not describe a Llama-family model") from e


def weight_files(folder) -> list[Path]:
    """The checkpoint's .safetensors files: the shards named by the index, else all of them."""
    folder = Path(folder)
    index = folder / _INDEX
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"can't read the shard index {index}: {e}; re-download it") from e
        files = [folder / n for n in sorted(set(wmap.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{folder} lacks shard(s) {', '.join(absent)} listed in "
                                 f"{_INDEX}; the download is incomplete")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin"))[:1] or sorted(
            p.name for p in folder.glob("*.pt"))[:1]
        hint = (f" (found {other[0]}: convert PyTorch checkpoints to safetensors, e.g. "
                "model.save_pretrained(dir, safe_serialization=True))") if other else ""
        raise ModelLoadError(f"{folder} has no *.safetensors weights{hint}")
    return files


def tensor_shapes(files: list[Path]) -> dict:
    """name -> shape of every tensor in the files, from their headers (no tensor is read)."""
    from safetensors import safe_open
    shapes = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for name in h.keys():
                    shapes[name] = tuple(h.get_slice(name).get_shape())
        except Exception as e:  # SafetensorError, OSError: corrupt header or truncated file
            raise ModelLoadError(
                f"{f} is not a valid safetensors file ({e}); re-download it") from e
    return shapes


class StoredTensor:
    """A tensor of a safetensors file read when asked: whole (`copy_into`), or only a part
    (`part`: a tensor-parallel rank's rows or columns, the rest never read)."""

    def __init__(self, handle, name: str, where):
        self._handle, self.name, self._where = handle, name, where
        self.shape = tuple(handle.get_slice(name).get_shape())

    def _read(self, how):
        try:
            return how()
        except Exception as e:
            raise ModelLoadError(f"can't read tensor {self.name} from {self._where} ({e}); "
                                 "the file is corrupt, re-download it") from e

    def copy_into(self, target) -> None:
        target.copy_(self._read(lambda: self._handle.get_tensor(self.name)))

    def part(self, dim: int, start: int, length: int):
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._read(lambda: self._handle.get_slice(self.name)[index])


def iter_safetensors(files: list[Path], quiet: bool = False,
                     lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, with a progress bar over tensors;
    lazy: each a StoredTensor, read by whoever takes it (whole or a part)."""
    from safetensors import safe_open
    from tqdm import tqdm
    handles = []
    for f in files:
        try:
            handles.append((f, safe_open(str(f), framework="pt", device="cpu")))
        except Exception as e:  # SafetensorError, OSError: corrupt header or truncated file
            raise ModelLoadError(
                f"{f} is not a valid safetensors file ({e}); re-download it") from e
    total = sum(len(h.keys()) for _, h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", file=sys.stderr,
              disable=quiet, leave=False) as bar:
        for f, h in handles:
            for name in h.keys():
                if lazy:
                    yield name, StoredTensor(h, name, f)
                    bar.update(1)
                    continue
                try:
                    t = h.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(f"can't read tensor {name} from {f} ({e}); "
                                         "the file is corrupt, re-download it") from e
                yield name, t
                bar.update(1)


def load_hf_folder(folder, dtype=None, device="cpu", quiet: bool = False,
                   max_positions=None, tp=None):
    """-> (model, ModelConfig). dtype: the activations' (None: float32). max_positions: the
    positions the rope tables cover (None: the model's max_position_embeddings). tp: a
    tensor-parallel rank's share (None: the whole model)."""
    import torch
    dtype = torch.float32 if dtype is None else dtype
    from outpace.models.loader.shapes import check_shapes
    from outpace.models.registry import model_class
    cfg = read_hf_config(folder)
    files = weight_files(folder)
    # the config against the weights' headers before anything is allocated from it
    check_shapes(cfg, tensor_shapes(files), folder)
    model = model_class(cfg.architecture)(cfg, dtype=dtype, device=device,
                                          max_positions=max_positions,
                                          **({} if tp is None else {"tp": tp}))
    # a tensor-parallel rank reads only its part of each sharded tensor
    model.load_weights(iter_safetensors(files, quiet, lazy=tp is not None and tp.size > 1))
    return model.eval(), cfg
