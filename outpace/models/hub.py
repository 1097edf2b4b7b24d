"""Hugging Face model ids (`Qwen/Qwen2.5-0.5B-Instruct`) -> a model folder in the Hugging Face
cache, as vLLM resolves them.

The cache is looked at first (no network), then the hub is asked through
`huggingface_hub.snapshot_download`, which honours HF_HUB_CACHE / HF_HOME, HF_ENDPOINT,
HF_TOKEN and HF_HUB_OFFLINE. Only what outpace loads is fetched: config and tokenizer files,
then the safetensors weights the shard index names (or the top-level *.safetensors without
one), so a repository's other formats (PyTorch .bin, original/ consolidated checkpoints, GGUF
files) are never downloaded. The config comes alone first where only it is needed
(`weights=False`): the engine checks its arguments against it before the weights are fetched.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional

from outpace.errors import ModelLoadError

# owner/name as the hub spells repository ids: word characters, '-' and '.', no '--' or '..'
_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
# A name ending like a file of a model is a mistyped local path, not an id.
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin")
# The files a model folder needs besides its weights (config, tokenizer, chat template).
_META_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_INDEX = "model.safetensors.index.json"


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a Hugging Face repository id (owner/name)."""
    return (bool(_ID.fullmatch(name)) and "--" not in name and ".." not in name
            and not name.lower().endswith(_FILE_SUFFIXES))


def _complete(folder: Path) -> bool:
    """The snapshot holds config.json and every weight file (the index's shards, else some
    top-level *.safetensors)."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / _INDEX
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return all((folder / s).is_file() for s in shards)
    return any(folder.glob("*.safetensors"))


def _weight_patterns(folder: Path) -> list:
    """The weight files to fetch once the config and index are in `folder`."""
    index = folder / _INDEX
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"can't read the shard index {index}: {e}; delete that "
                                 f"snapshot from the Hugging Face cache and try again") from e
    return ["*.safetensors"]


def _why(e: Exception) -> tuple[str, bool]:
    """A download failure in words that say what to change -> (the reason, whether it is the
    network: no connection, or HF_HUB_OFFLINE)."""
    # huggingface_hub's exception classes moved between its releases: matched by name
    names = {c.__name__ for c in type(e).__mro__}
    if "GatedRepoError" in names:
        return ("the model is gated: accept its license on huggingface.co and set HF_TOKEN "
                "(or run `hf auth login`)"), False
    if "RepositoryNotFoundError" in names:
        return ("the hub has no such model (or it is private: set HF_TOKEN); check the id's "
                "spelling"), False
    if "RevisionNotFoundError" in names:
        return "the hub has no such revision of the model", False
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set, so nothing is downloaded", True
    first = str(e).strip().splitlines()
    return f"the hub could not be reached ({first[0] if first else type(e).__name__})", True


def snapshot(repo_id: str, cache_dir: Optional[str] = None, quiet: bool = False,
             weights: bool = True) -> Path:
    """The local folder of Hugging Face model `repo_id`: its snapshot in the cache (`cache_dir`,
    else huggingface_hub's: HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub), downloaded
    there first when it is not complete. weights=False: a snapshot with config.json is enough
    (only the config and tokenizer files are fetched when it has none). Raises ModelLoadError
    saying why it could not be fetched and how to pass a local folder instead."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # a dependency of transformers, so normally present
        raise ModelLoadError(f"{repo_id!r} looks like a Hugging Face model id, but "
                             f"huggingface_hub is not installed (pip install huggingface_hub); "
                             f"or pass a local model folder") from e
    kw = dict(cache_dir=str(Path(cache_dir).expanduser()) if cache_dir else None)
    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True, **kw))
        if _complete(folder) or (not weights and (folder / "config.json").is_file()):
            return folder
        has_config = (folder / "config.json").is_file()
    except Exception:  # noqa: BLE001 - any failure to find it locally means: download it
        has_config = False
    if not quiet:
        what = f"{repo_id}'s weights" if has_config else repo_id
        print(f"outpace: fetching {what} from the Hugging Face hub", file=sys.stderr)
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=_META_PATTERNS, **kw))
        if not (folder / "config.json").is_file():
            ggufs = " (it holds GGUF files: download the one you want and pass its path)" \
                if _has_gguf(repo_id) else ""
            raise ModelLoadError(f"Hugging Face model {repo_id!r} has no config.json{ggufs}: "
                                 f"outpace loads Hugging Face folders (config.json and "
                                 f"safetensors) and .gguf files. If the hub was not reachable "
                                 f"(the cache at {folder.parent.parent.parent} is used then), "
                                 f"{_offline_advice(repo_id)}")
        if not weights:
            return folder
        folder = Path(snapshot_download(repo_id, allow_patterns=_weight_patterns(folder),
                                        ignore_patterns=["*/*"], **kw))
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - the hub's and the network's errors, reworded
        from huggingface_hub import constants
        reason, network = _why(e)
        cache = kw["cache_dir"] or constants.HF_HUB_CACHE
        where = (f" It is not (complete) in the Hugging Face cache ({cache}): to run it without "
                 f"a network, {_offline_advice(repo_id)}.") if network else ""
        raise ModelLoadError(f"could not fetch Hugging Face model {repo_id!r} (no local folder "
                             f"of that name exists): {reason}.{where}") from e
    if not _complete(folder):
        # snapshot_download falls back to the cached snapshot when the hub can't be reached
        raise ModelLoadError(f"Hugging Face model {repo_id!r} has no *.safetensors weights in "
                             f"the cache ({folder}): either the hub was not reachable (then "
                             f"{_offline_advice(repo_id)}), or the model has only PyTorch .bin "
                             f"weights, which outpace does not load (pass a .gguf file of it)")
    return folder


def _offline_advice(repo_id: str) -> str:
    return (f"download it where there is a network (`hf download {repo_id} --local-dir DIR`), "
            f"copy DIR here and pass DIR as the model")


def _has_gguf(repo_id: str) -> bool:
    """Whether the repository holds .gguf files (asked only to word an error)."""
    try:
        from huggingface_hub import list_repo_files
        return any(f.endswith(".gguf") for f in list_repo_files(repo_id))
    except Exception:  # noqa: BLE001 - only a hint
        return False
