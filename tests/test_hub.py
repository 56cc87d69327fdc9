"""Hugging Face model ids (`"path": "Org/Tiny"`) resolved from a fake local HF cache laid out on disk."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import types
from pathlib import Path

import pytest

import lumen_core as lumen
from lumen_core.checkpoint.hub import hub_cache_dir, is_model_id
from lumen_core.cli import main
from lumen_core.config import config_from_path_or_model, load_config
from lumen_core.errors import CheckpointError, ConfigError

MAIN = "a" * 40
OTHER = "b" * 40
PROMPT = [1, 5, 9, 2, 7]


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint, make_tiny, tmp_path_factory):
    """Two tiny checkpoints with different weights: the main branch's and another revision's."""
    return tiny_checkpoint("qwen3_5"), make_tiny.make("qwen3_5", tmp_path_factory.mktemp("other"), seed=1)


def lay_out(cache: Path, repo_id: str, commit: str, src: Path, refs: tuple[str, ...] = (), links: bool = False):
    """A snapshot of `src` at `commit` as huggingface_hub writes it (files, or links into blobs/)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir():
        if links:
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            blob.parent.mkdir(exist_ok=True)
            shutil.copyfile(f, blob)
            (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
        else:
            shutil.copyfile(f, snap / f.name)
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def cache(tmp_path, monkeypatch, ckpts):
    """HF_HUB_CACHE with Org/Tiny: main (linked, as downloads are) at MAIN, branch `other` at OTHER."""
    root = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("LUMEN_ALLOW_DOWNLOAD", raising=False)
    monkeypatch.chdir(tmp_path)  # "Org/Tiny" is no path relative to the working directory
    lay_out(root, "Org/Tiny", MAIN, ckpts[0], refs=("main",), links=True)
    lay_out(root, "Org/Tiny", OTHER, ckpts[1], refs=("other",))
    return root


def tokens(source) -> list[int]:
    return list(lumen.load(source, progress=False).generate_tokens(PROMPT, max_tokens=8))


def test_the_cache_dir_follows_hf_hub_cache_then_hf_home_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == tmp_path / "c"


@pytest.mark.parametrize("text,expected", [
    ("Qwen/Qwen3.5-9B", True), ("Org/Tiny", True), ("google/gemma-3-270m-it", True),
    ("gpt2", False), ("x", False), ("./Org/Tiny", False), ("/Org/Tiny", False), ("a/b/c", False),
    ("Org/model.gguf", False), ("configs/run.json", False), ("Org/a..b", False), ("Org--x/y", False),
    ("-Org/x", False), ("Org/x-", False), ("~/x", False),
])
def test_what_reads_as_a_model_id(text, expected):
    assert is_model_id(text) is expected


def test_a_model_id_generates_what_the_directory_does(cache, ckpts):
    expected = tokens({"model": {"path": str(ckpts[0])}})
    assert tokens({"model": {"path": "Org/Tiny"}}) == expected
    assert tokens({"model": {"path": "Org/Tiny"}}) != tokens({"model": {"path": str(ckpts[1])}})  # can fail


def test_the_cache_under_hf_home_and_under_home(cache, ckpts, monkeypatch, tmp_path):
    expected = tokens({"model": {"path": str(ckpts[0])}})
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(CheckpointError, match="hf-home/hub/models--Org--Tiny"):
        _ = load_config({"model": {"path": "Org/Tiny"}}).model_path
    shutil.copytree(cache, tmp_path / "hf-home" / "hub", symlinks=True)
    assert tokens({"model": {"path": "Org/Tiny"}}) == expected
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    shutil.copytree(cache, tmp_path / "home" / ".cache" / "huggingface" / "hub", symlinks=True)
    assert load_config({"model": {"path": "Org/Tiny"}}).model_path == (
        tmp_path / "home" / ".cache" / "huggingface" / "hub" / "models--Org--Tiny" / "snapshots" / MAIN)


def test_revision_by_branch_by_commit_and_by_short_commit(cache, ckpts):
    other = tokens({"model": {"path": str(ckpts[1])}})
    assert tokens({"model": {"path": "Org/Tiny", "revision": "other"}}) == other
    assert tokens({"model": {"path": "Org/Tiny", "revision": OTHER}}) == other
    snap = cache / "models--Org--Tiny" / "snapshots"
    assert load_config({"model": {"path": "Org/Tiny", "revision": MAIN[:7]}}).model_path == snap / MAIN
    assert load_config({"model": {"path": "Org/Tiny", "revision": "main"}}).model_path == snap / MAIN


def test_an_unknown_revision_names_what_is_cached(cache):
    config = load_config({"model": {"path": "Org/Tiny", "revision": "v2.0"}})  # validating reads no cache
    with pytest.raises(CheckpointError) as err:
        _ = config.model_path
    text = str(err.value)
    assert "Org/Tiny" in text and "v2.0" in text and "cached refs: main, other" in text
    assert "hf download Org/Tiny --revision v2.0" in text


def test_a_path_on_disk_wins_over_an_id(cache, ckpts, tmp_path):
    (tmp_path / "Org").mkdir()
    shutil.copytree(ckpts[1], tmp_path / "Org" / "Tiny")
    assert load_config({"model": {"path": "Org/Tiny"}}).model_path == tmp_path / "Org" / "Tiny"
    assert tokens({"model": {"path": "Org/Tiny"}}) == tokens({"model": {"path": str(ckpts[1])}})
    with pytest.raises(ConfigError, match=r"model.revision: .* is a path on disk"):
        _ = load_config({"model": {"path": "Org/Tiny", "revision": "main"}}).model_path


def test_a_missing_id_names_the_id_the_cache_path_and_the_fix(cache, monkeypatch):
    fake = types.ModuleType("huggingface_hub")
    fake.snapshot_download = lambda *a, **k: pytest.fail("downloaded without being asked")
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    with pytest.raises(CheckpointError) as err:
        lumen.load({"model": {"path": "Qwen/Qwen3.5-9B"}}, progress=False)
    text = str(err.value)
    assert "Qwen/Qwen3.5-9B" in text
    assert str(cache / "models--Qwen--Qwen3.5-9B") in text
    assert "hf download Qwen/Qwen3.5-9B" in text and "LUMEN_ALLOW_DOWNLOAD=1" in text and '".[hub]"' in text


def test_download_when_asked_needs_the_hub_extra(cache, monkeypatch):
    monkeypatch.setenv("LUMEN_ALLOW_DOWNLOAD", "1")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed: import fails
    with pytest.raises(CheckpointError) as err:
        _ = load_config({"model": {"path": "Qwen/Qwen3.5-9B"}}).model_path
    text = str(err.value)
    assert "huggingface_hub is not installed" in text and 'pip install -e ".[hub]"' in text
    assert "Traceback" not in text


def test_download_when_asked_uses_huggingface_hub(cache, ckpts, monkeypatch):
    calls = []

    def snapshot_download(repo_id, revision=None, cache_dir=None):
        calls.append((repo_id, revision, cache_dir))
        return lay_out(Path(cache_dir), repo_id, "c" * 40, ckpts[0], refs=("main",))

    fake = types.ModuleType("huggingface_hub")
    fake.snapshot_download = snapshot_download
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    monkeypatch.setenv("LUMEN_ALLOW_DOWNLOAD", "1")
    assert tokens({"model": {"path": "New/Model"}}) == tokens({"model": {"path": str(ckpts[0])}})
    assert calls == [("New/Model", None, str(cache))]
    tokens({"model": {"path": "New/Model"}})  # cached now: no second download
    assert len(calls) == 1

    def failing(*a, **k):
        raise OSError("network is unreachable")

    fake.snapshot_download = failing
    with pytest.raises(CheckpointError, match=r"Gone/Model: downloading it into .* failed: OSError: network"):
        _ = load_config({"model": {"path": "Gone/Model"}}).model_path


def test_a_partial_snapshot_is_a_clear_error(cache, ckpts):
    snap = cache / "models--Org--Tiny" / "snapshots" / MAIN
    (snap / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"Org/Tiny: the snapshot .* has no config.json.*\n  fix: .*unfinished"):
        lumen.load({"model": {"path": "Org/Tiny"}}, progress=False)
    other = cache / "models--Org--Tiny" / "snapshots" / OTHER
    for w in other.glob("*.safetensors"):
        w.unlink()
    with pytest.raises(CheckpointError, match="has config.json but no \\*.safetensors"):
        _ = load_config({"model": {"path": "Org/Tiny", "revision": "other"}}).model_path


def test_a_missing_blob_or_shard_is_a_partial_snapshot(cache, ckpts):
    snap = cache / "models--Org--Tiny" / "snapshots" / MAIN
    weights = sorted(snap.glob("*.safetensors"))
    assert weights and weights[0].is_symlink()
    weights[0].resolve().unlink()  # the link stays, its blob is gone
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        _ = load_config({"model": {"path": "Org/Tiny"}}).model_path
    other = cache / "models--Org--Tiny" / "snapshots" / OTHER
    shard = next(other.glob("*.safetensors")).name
    (other / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": shard, "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"lacks 1 of 2 weight files \(model-00002-of-00002.safetensors\)"):
        _ = load_config({"model": {"path": "Org/Tiny", "revision": "other"}}).model_path


def test_a_ref_to_a_missing_snapshot_is_not_cached(cache):
    (cache / "models--Org--Tiny" / "refs" / "main").write_text("d" * 40)
    with pytest.raises(CheckpointError, match=f"no snapshot for refs/main -> commit {'d' * 40}"):
        _ = load_config({"model": {"path": "Org/Tiny"}}).model_path


def test_a_gguf_repo_resolves_to_its_one_gguf_file(cache, tmp_path):
    src = tmp_path / "gguf-src"
    src.mkdir()
    (src / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    snap = lay_out(cache, "Org/Tiny-GGUF", MAIN, src, refs=("main",))
    assert load_config({"model": {"path": "Org/Tiny-GGUF"}}).model_path == snap / "model-Q4_K_M.gguf"
    (snap / "model-Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="holds 2 GGUF files .*set model.path to the one to run"):
        _ = load_config({"model": {"path": "Org/Tiny-GGUF"}}).model_path


def test_config_from_an_id_and_a_bare_name_stays_a_config_file(cache):
    assert config_from_path_or_model("Org/Tiny").raw["model"] == {"path": "Org/Tiny", "compute": "cpu",
                                                                  "store": "ram"}
    with pytest.raises(ConfigError):
        config_from_path_or_model("tiny")  # not an id: a config file that does not exist


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_config_takes_a_model_id(cache, ckpts, capsys):
    code, out, err = run(capsys, "generate", "--config", "Org/Tiny", "--prompt", "The sky is", "-n", "6", "-q")
    code2, out2, _ = run(capsys, "generate", "--config", str(ckpts[0]), "--prompt", "The sky is", "-n", "6", "-q")
    assert code == 0 and code2 == 0, err
    assert out == out2 and out


def test_cli_missing_id_is_one_message_without_traceback(cache, capsys):
    code, out, err = run(capsys, "generate", "--config", "Qwen/Qwen3.5-9B", "--prompt", "Hi", "-n", "2", "-q")
    assert code == 2 and out == ""
    assert err.startswith("lumen: error: model id Qwen/Qwen3.5-9B is not in the local Hugging Face cache")
    assert str(cache / "models--Qwen--Qwen3.5-9B") in err and "Traceback" not in err
