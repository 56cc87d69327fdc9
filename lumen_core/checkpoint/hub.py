"""Hugging Face model ids (``Qwen/Qwen3.5-9B``) resolved from the local Hugging Face cache.

The cache is the one transformers, vLLM and mlx-lm share: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``. A model lives in ``models--Org--Name/``: ``snapshots/<commit>/`` holds its files
and ``refs/<branch or tag>`` holds the commit of that branch (``refs/main`` by default).

Nothing is downloaded unless the user asked for it: ``LUMEN_ALLOW_DOWNLOAD=1`` with the ``hub`` extra
(``pip install -e ".[hub]"``, which brings ``huggingface_hub``) downloads a model that is not cached.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import CheckpointError

ALLOW_DOWNLOAD_ENV = "LUMEN_ALLOW_DOWNLOAD"
DEFAULT_REVISION = "main"

# org/name as the Hub spells them: letters, digits, - _ . ; not starting with - or . ; no "--" or ".." inside.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_ID = re.compile(rf"({_PART})/({_PART})")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_COMMIT_PREFIX = re.compile(r"[0-9a-f]{7,39}")


def is_model_id(text: str) -> bool:
    """True for ``org/name`` (what the Hub spells); bare names, paths and *.gguf / *.json names are not ids.

    Bare legacy ids (``gpt2``) are not read as ids: a bare name is a relative path or a config file name, and
    every legacy model has an ``org/name`` spelling (``openai-community/gpt2``)."""
    if not _ID.fullmatch(text) or "--" in text or ".." in text:
        return False
    return not text.lower().endswith((".gguf", ".json"))


def hub_cache_dir() -> Path:
    """Where the Hugging Face cache is: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def download_allowed() -> bool:
    return os.environ.get(ALLOW_DOWNLOAD_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _repo_dir(repo_id: str) -> Path:
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def _download_hint(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return (f"download it with `hf download {repo_id}{rev}` (older huggingface_hub: `huggingface-cli download "
            f"{repo_id}{rev}`), or let lumen download it: pip install -e \".[hub]\" and set "
            f"{ALLOW_DOWNLOAD_ENV}=1; or set model.path to a checkpoint directory or .gguf file")


def _safe_name(text: str) -> bool:
    return bool(text) and not text.startswith("/") and ".." not in text.split("/") and "\\" not in text


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _snapshot(repo: Path, revision: str) -> tuple[Path | None, str]:
    """(snapshot dir or None, how the revision was read) in the cached repo ``repo``."""
    snapshots, refs = repo / "snapshots", repo / "refs"
    if _COMMIT.fullmatch(revision):
        return (snapshots / revision if (snapshots / revision).is_dir() else None), f"commit {revision}"
    if _safe_name(revision) and (refs / revision).is_file():
        commit = _read(refs / revision)
        if not commit or not _safe_name(commit):
            return None, f"refs/{revision} (unreadable or empty)"
        snap = snapshots / commit
        return (snap if snap.is_dir() else None), f"refs/{revision} -> commit {commit}"
    if _COMMIT_PREFIX.fullmatch(revision) and snapshots.is_dir():
        found = sorted(p for p in snapshots.iterdir() if p.name.startswith(revision) and p.is_dir())
        if len(found) == 1:
            return found[0], f"commit {found[0].name}"
    return None, f"revision {revision!r}"


def _cached_list(repo: Path) -> str:
    def names(d: Path) -> list[str]:
        try:
            return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
        except OSError:
            return []

    refs = names(repo / "refs")
    try:
        snaps = sorted(p.name for p in (repo / "snapshots").iterdir() if p.is_dir())
    except OSError:
        snaps = []
    return f"cached refs: {', '.join(refs) or 'none'}; cached snapshots: {', '.join(snaps) or 'none'}"


def check_snapshot(snapshot: Path, repo_id: str, revision: str | None) -> Path:
    """The checkpoint in a snapshot: the dir (config.json and every safetensors shard), or its one .gguf file.
    A partial download (config.json or weights missing, a broken link to a blob) is a CheckpointError."""
    def exists(p: Path) -> bool:
        try:
            return p.is_file()  # follows the snapshot's links to blobs/: a missing blob is a missing file
        except OSError:
            return False

    fix = (f"the download of {repo_id} looks unfinished; finish it with `hf download {repo_id}"
           f"{f' --revision {revision}' if revision else ''}` (it resumes), or set model.path to a "
           "complete checkpoint")
    if not exists(snapshot / "config.json"):
        ggufs = sorted(p for p in snapshot.glob("*.gguf") if exists(p))
        if len(ggufs) == 1:
            return ggufs[0]
        if ggufs:
            raise CheckpointError(
                f"model id {repo_id}: the snapshot {snapshot} holds {len(ggufs)} GGUF files "
                f"({', '.join(p.name for p in ggufs)}): set model.path to the one to run, e.g. {ggufs[0]}")
        raise CheckpointError(f"model id {repo_id}: the snapshot {snapshot} has no config.json (and no .gguf "
                              f"file)\n  fix: {fix}")
    index = snapshot / "model.safetensors.index.json"
    if exists(index):
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            shards = []  # a corrupt index: the checkpoint reader says what is wrong with it
        missing = [s for s in shards if not exists(snapshot / s)]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CheckpointError(f"model id {repo_id}: the snapshot {snapshot} lacks {len(missing)} of "
                                  f"{len(shards)} weight files ({shown})\n  fix: {fix}")
    if not any(exists(p) for p in snapshot.glob("*.safetensors")):
        raise CheckpointError(f"model id {repo_id}: the snapshot {snapshot} has config.json but no *.safetensors "
                              f"weights\n  fix: {fix}")
    return snapshot


def _download(repo_id: str, revision: str | None) -> Path:
    try:
        import huggingface_hub
    except ImportError:
        raise CheckpointError(
            f"model id {repo_id} is not in the Hugging Face cache ({_repo_dir(repo_id)}) and {ALLOW_DOWNLOAD_ENV} "
            "asks lumen to download it, but huggingface_hub is not installed\n"
            "  fix: pip install -e \".[hub]\" (or pip install huggingface_hub), or download it yourself with "
            f"`hf download {repo_id}` and unset {ALLOW_DOWNLOAD_ENV}") from None
    try:
        path = huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=str(hub_cache_dir()))
    except Exception as exc:  # network, auth, no such repo or revision: all said in one line
        raise CheckpointError(f"model id {repo_id}: downloading it into {hub_cache_dir()} failed: "
                              f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                              "\n  fix: check the id, the revision and the network (a gated model needs "
                              "`hf auth login`), or download it with `hf download "
                              f"{repo_id}`") from None
    return Path(path)


def resolve_model_id(repo_id: str, revision: str | None = None) -> Path:
    """The checkpoint of ``repo_id`` at ``revision`` (branch, tag or commit; None: main) in the local cache.

    Not cached: downloaded only when LUMEN_ALLOW_DOWNLOAD=1, else a CheckpointError naming the id, the cache
    dir searched and how to fix it."""
    repo = _repo_dir(repo_id)
    rev = revision or DEFAULT_REVISION
    snapshot, how = _snapshot(repo, rev) if repo.is_dir() else (None, f"revision {rev!r}")
    if snapshot is None:
        if download_allowed():
            return check_snapshot(_download(repo_id, revision), repo_id, revision)
        where = (f"{repo} is cached but has no snapshot for {how} ({_cached_list(repo)})" if repo.is_dir()
                 else f"searched {repo}, which does not exist")
        cache_note = "HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub"
        raise CheckpointError(
            f"model id {repo_id}{f' (revision {revision})' if revision else ''} is not in the local Hugging "
            f"Face cache: {where} (the cache is {cache_note}); lumen downloads nothing unless asked\n"
            f"  fix: {_download_hint(repo_id, revision)}")
    return check_snapshot(snapshot, repo_id, revision)
