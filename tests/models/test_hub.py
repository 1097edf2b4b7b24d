"""Hugging Face model ids: resolved in a local folder laid out as the hub cache, never on the
network (the failure cases point HF_ENDPOINT at a closed local port, or set HF_HUB_OFFLINE, in a
subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from outpace.errors import ModelLoadError
from outpace.models.catalog import resolve_model
from outpace.models.hub import is_hub_id
from outpace.models.loader import load_model_config, locate
from tests.models.helpers import tiny_hf, word_tokenizer

REPO = Path(__file__).resolve().parents[2]
REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_layout(cache: Path, repo_id: str) -> Path:
    """`cache` laid out as huggingface_hub's: models--owner--name/{refs/main, snapshots/<commit>/}
    -> the snapshot folder (here plain files; the hub's own are links into blobs/)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    snap = hub_layout(cache, REPO_ID)
    tiny_hf("llama", seed=3).save_pretrained(snap)
    word_tokenizer(snap)
    return cache, snap


def test_what_reads_as_a_model_id():
    for name in ("Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.2-1B", "a/b", "org/m.v1_2"):
        assert is_hub_id(name), name
    for name in ("qwen", "/abs/path", "./rel/dir", "~/models/x", "a/b/c", "org/model.gguf",
                 "dir/config.json", "org/a--b", "org/a..b", "-org/x", "org/", "/x"):
        assert not is_hub_id(name), name


def test_id_resolves_in_the_hub_cache_without_the_network(hub_cache):
    cache, snap = hub_cache
    assert resolve_model(REPO_ID, download_dir=str(cache)) == snap
    assert locate(REPO_ID, download_dir=cache) == ("hf", snap)
    assert load_model_config(REPO_ID, download_dir=cache).vocab_size == 96


def test_a_local_folder_wins_over_an_id(hub_cache, tmp_path, monkeypatch):
    local = tmp_path / REPO_ID
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO_ID, download_dir=str(hub_cache[0])) == Path(REPO_ID)


def test_engine_runs_a_model_id(hub_cache):
    from outpace.engine.engine import LLMEngine
    from outpace.types import SamplingParams
    eng = LLMEngine.from_args(REPO_ID, download_dir=str(hub_cache[0]), device="cpu",
                              num_kv_blocks=32, quiet=True)
    eng.add_request("r", [1, 5, 6], SamplingParams(max_tokens=3, temperature=0.0,
                                                   ignore_eos=True))
    out = []
    while eng.has_unfinished_requests():
        out += [o for o in eng.step() if o.finished]
    assert len(out[0].token_ids) == 3 and eng.model_name == REPO_ID


def _cli(args, env_extra, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run([sys.executable, "-m", "outpace.entrypoints.cli", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _one_error(r, notice: str) -> str:
    """The run failed with one `outpace: error:` line (after the fetch notice, if any), no
    traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[:-1] == ([notice] if notice else []), r.stderr
    assert lines[-1].startswith("outpace: error: "), r.stderr
    return lines[-1]


def _closed_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the socket is: connections are refused


def test_cli_finds_an_id_in_HF_HUB_CACHE(hub_cache):
    cache, _ = hub_cache
    r = _cli(["generate", "w1 w2", "--model", REPO_ID, "--device", "cpu", "--max-tokens", "2",
              "--num-kv-blocks", "32", "--quiet", "--raw"],
             {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"})
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("offline", [False, True])
def test_id_that_cannot_be_fetched_is_one_clear_error(tmp_path, offline):
    """Not in the cache and no network (a refused connection, or HF_HUB_OFFLINE): one
    `outpace: error:` line that says the id could not be fetched and how to pass a folder."""
    env = {"HF_HUB_CACHE": str(tmp_path / "empty-cache"),
           "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    r = _cli(["generate", "hi", "--model", "tiny-org/not-here", "--device", "cpu"], env)
    line = _one_error(r, "outpace: fetching tiny-org/not-here from the Hugging Face hub")
    assert line.startswith("outpace: error: could not fetch Hugging Face model "
                           "'tiny-org/not-here' (no local folder of that name exists): ")
    assert ("HF_HUB_OFFLINE is set" if offline else "the hub could not be reached") in line
    assert "hf download tiny-org/not-here --local-dir DIR" in line
    assert "pass DIR as the model" in line and str(tmp_path / "empty-cache") in line


def _config_only_snapshot(cache: Path) -> Path:
    """A snapshot with its config and tokenizer but no weights (an interrupted download)."""
    snap = hub_layout(cache, REPO_ID)
    model = tiny_hf("llama", seed=3)
    model.config.save_pretrained(snap)
    word_tokenizer(snap)
    return snap


def test_incomplete_snapshot_is_fetched_again(tmp_path):
    """A snapshot without its weights (an interrupted download) is not used as it is: the hub
    is asked for the rest, and without it the error says what to do."""
    snap = _config_only_snapshot(tmp_path)
    r = _cli(["generate", "hi", "--model", REPO_ID, "--device", "cpu",
              "--download-dir", str(tmp_path)],
             {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"})
    _one_error(r, f"outpace: fetching {REPO_ID}'s weights from the Hugging Face hub")
    assert (f"'{REPO_ID}' has no *.safetensors weights in the cache ({snap}): either the hub "
            f"was not reachable (then download it where there is a network (`hf download "
            f"{REPO_ID} --local-dir DIR`), copy DIR here and pass DIR as the model), or the "
            f"model has only PyTorch .bin weights") in r.stderr


def test_max_model_len_is_checked_against_the_config_before_the_weights_are_fetched(tmp_path):
    """--max-model-len beyond the config's positions: refused from the config alone, the
    weights never asked for (the same snapshot without the flag goes on to fetch them)."""
    _config_only_snapshot(tmp_path)
    r = _cli(["generate", "hi", "--model", REPO_ID, "--device", "cpu", "--max-model-len", "129",
              "--download-dir", str(tmp_path)],
             {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"})
    assert _one_error(r, "") == ("outpace: error: --max-model-len=129 is longer than the "
                                 "model's 128 positions; use at most 128")


def test_the_config_of_an_id_comes_without_its_weights(tmp_path):
    snap = _config_only_snapshot(tmp_path)
    assert locate(REPO_ID, download_dir=tmp_path, weights=False) == ("hf", snap)
    assert load_model_config(REPO_ID, download_dir=tmp_path).max_position_embeddings == 128
