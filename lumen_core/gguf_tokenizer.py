"""Rebuild a checkpoint's tokenizer from GGUF metadata (``tokenizer.ggml.*``) as a ``tokenizers.Tokenizer``.

A GGUF carries no ``tokenizer.json``: only the vocabulary, scores, token types, merges (byte-level BPE) and the
special token ids. We rebuild the same pipeline transformers 5 builds from them (``AutoTokenizer.from_pretrained(
dir, gguf_file=...)``), so ids and decoded text agree with it:

- ``llama`` (SentencePiece-style BPE with byte fallback): the merges are not stored, so they are derived from the
  vocabulary: every way of cutting a token into two tokens, best token first. Gemma files rank tokens by their
  position in the vocabulary (their scores do not follow the merge order) and spell runs of spaces with real
  spaces, which are respelt with ``▁`` first. Gemma keeps spaces through a ``Replace(" ", "▁")`` normalizer;
  other SentencePiece files use a ``Metaspace`` pre-tokenizer that prepends ``▁`` to the first word.
- ``gpt2`` (byte-level BPE): the vocabulary is respelt in the byte alphabet where needed, the merges are stored,
  and ``tokenizer.ggml.pre`` picks the split regex.

Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain added tokens, so they
are matched whole. Only ``tokenizers`` and the standard library are needed at run time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from .errors import CheckpointError

SPIECE = "\u2581"  # SentencePiece's visible space
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3", "gemma3n", "gemma4")
# The metadata ids of the named special tokens, as the tokenizer config calls them.
SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
# llama.cpp's other end-of-generation tokens: generation stops on them too.
EXTRA_EOS_IDS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

# Pre-tokenizer split patterns of byte-level vocabularies, by `tokenizer.ggml.pre` (the families transformers
# knows; any other name gets GPT-2's own pattern through the ByteLevel pre-tokenizer).
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_PATTERNS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}


def tokenizer_from_metadata(metadata: dict, path: str | Path | None = None):
    """The ``lumen_core.tokenizer.Tokenizer`` a GGUF file's metadata describes (cached per file)."""
    from .tokenizer import Tokenizer

    built, note = _cached_build(metadata, Path(path)) if path is not None else (build(metadata, path), "")
    tok = Tokenizer(
        built.backend,
        special_tokens=built.special_tokens,
        bos_id=built.bos_id,
        eos_ids=built.eos_ids,
        add_bos_token=built.add_bos,
        chat_template=built.chat_template,
    )
    tok.load_note = note  # for the load's progress line
    return tok


CACHE_VERSION = 1  # bump when build() changes what it produces
# The cache keeps its most recently used files within this many bytes (Gemma's 262k vocabulary: 21 MB a file): a
# GGUF moved, edited or made in a temporary directory leaves an entry no key will match again.
CACHE_MAX_BYTES = 512 << 20


def cache_dir() -> Path:
    return Path(os.environ.get("LUMEN_CACHE", Path.home() / ".cache" / "lumen")) / "tokenizers"


def _cached_build(metadata: dict, path: Path) -> tuple[Built, str]:
    """Rebuilding a 262k-entry vocabulary takes ~2 s on 2 cores; reading the built one back takes ~0.9 s.
    The cache key is the file's path, size and mtime, so an edited or replaced file is rebuilt. Returns the
    tokenizer and what happened ("from the cache", "built; cached in DIR")."""
    st = path.stat()
    key = hashlib.sha256(f"{CACHE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    cached = cache_dir() / f"{key[:32]}.json"
    try:
        entry = json.loads(cached.read_text(encoding="utf-8"))
        backend = tokenizers.Tokenizer.from_str(entry.pop("backend"))
        _touch(cached)  # most recently used: the last file pruning removes
        return Built(backend, entry["special_tokens"], entry["bos_id"], set(entry["eos_ids"]), entry["add_bos"],
                     entry["add_eos"], entry["chat_template"]), "from the cache"
    except Exception:  # no cache yet, or a corrupt one (tokenizers raises plain Exception): rebuild it
        pass
    built = build(metadata, path)
    entry = {"backend": built.backend.to_str(), "special_tokens": built.special_tokens, "bos_id": built.bos_id,
             "eos_ids": sorted(built.eos_ids), "add_bos": built.add_bos, "add_eos": built.add_eos,
             "chat_template": built.chat_template}
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry), encoding="utf-8")
        tmp.replace(cached)  # atomic: a concurrent reader never sees half a file
    except OSError:  # a read-only home only costs the rebuild next time
        return built, f"built; could not cache it in {cache_dir()}"
    prune(cached.parent, keep=cached)
    return built, f"built from the GGUF vocabulary, cached in {cache_dir()} for the next run"


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # a read-only cache still serves
        pass


def prune(directory: Path, max_bytes: int | None = None, keep: Path | None = None) -> int:
    """Delete the least recently used cache files (by modification time, which a read refreshes) until the rest fit
    in ``max_bytes`` (default ``CACHE_MAX_BYTES``); ``keep`` is never deleted. Returns the files deleted. Files
    another process deletes meanwhile, or that cannot be deleted, are skipped."""
    limit = CACHE_MAX_BYTES if max_bytes is None else max_bytes
    entries = []
    for f in directory.glob("*.json"):
        try:
            st = f.stat()
        except OSError:
            continue
        entries.append((st.st_mtime_ns, st.st_size, f))
    total, removed = sum(size for _, size, _ in entries), 0
    for _, size, f in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        if keep is not None and f == keep:
            continue
        try:
            f.unlink()
        except OSError:
            continue
        total -= size
        removed += 1
    return removed


class Built:
    """What ``build`` returns: the backend plus the special tokens and flags around it."""

    def __init__(self, backend, special_tokens, bos_id, eos_ids, add_bos, add_eos, chat_template):
        self.backend: tokenizers.Tokenizer = backend
        self.special_tokens: dict[str, str] = special_tokens
        self.bos_id: int | None = bos_id
        self.eos_ids: set[int] = eos_ids
        self.add_bos: bool = add_bos
        self.add_eos: bool = add_eos
        self.chat_template: str | dict[str, str] | None = chat_template


def build(metadata: dict, path: str | Path | None = None) -> Built:
    where = f"{path}: " if path else ""
    model = metadata.get("tokenizer.ggml.model")
    arch = metadata.get("general.architecture", "")
    model = "llama" if model == "gemma4" else model  # Gemma 4's converter names its SentencePiece-style BPE "gemma4"
    if "tokenizer.ggml.tokens" not in metadata:
        raise CheckpointError(f"{where}GGUF metadata has no tokenizer.ggml.tokens: no tokenizer to build")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type") or ())
    if model == "llama":
        if arch in GEMMA_ARCHS:
            backend, vocab = _gemma(tokens)
        elif arch == "phi3":
            backend, vocab = _sentencepiece(tokens, metadata, where, prefix="normalizer")
        else:
            backend, vocab = _sentencepiece(tokens, metadata, where, prefix="metaspace")
    elif model == "gpt2":
        backend, vocab = _byte_level(tokens, metadata, where)
    else:
        raise CheckpointError(
            f"{where}GGUF tokenizer model {model!r} is not supported (supported: 'llama' (SentencePiece-style "
            "BPE), 'gpt2' (byte-level BPE))"
        )

    # Control tokens are matched whole as special tokens, user-defined ones whole as ordinary tokens.
    byte_alphabet = set(_byte_alphabet().values()) if model == "gpt2" else None
    control = [t for t, ty in zip(tokens, types, strict=False)
               if ty == CONTROL and (byte_alphabet is None or set(t) <= byte_alphabet)]
    if control:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, ty in zip(tokens, types, strict=False) if ty == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    special = {}
    for key, meta_key in SPECIAL_IDS.items():
        i = metadata.get(meta_key)
        if isinstance(i, int) and 0 <= i < len(tokens):
            special[key] = tokens[i]
    if model == "llama" and arch in GEMMA_ARCHS and "<mask>" in vocab:
        special["mask_token"] = "<mask>"  # Gemma's tokenizer class names one more special token
    if special:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special.values()])

    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        add_bos = model == "llama"
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    bos = special.get("bos_token")
    eos = special.get("eos_token")
    add_bos = bool(add_bos) and bos is not None
    add_eos = add_eos and eos is not None
    backend.post_processor = _template(backend, bos if add_bos else None, eos if add_eos else None)

    bos_id = backend.token_to_id(bos) if bos is not None else None
    eos_ids = {backend.token_to_id(eos)} if eos is not None else set()
    for key in EXTRA_EOS_IDS:
        i = metadata.get(key)
        if isinstance(i, int) and 0 <= i < len(tokens):
            eos_ids.add(i)
    return Built(backend, special, bos_id, eos_ids, add_bos, add_eos, chat_template_from_metadata(metadata))


# --- vocabularies ----------------------------------------------------------------------------------------------


def _gemma(tokens: list[str]) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """Gemma: runs of spaces are stored as spaces but looked up as ``▁``; merges ranked by vocabulary position."""
    tokens = [SPIECE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = _vocab(tokens)
    scores = {t: -i for i, t in enumerate(tokens)}
    merges = _merges_from_vocab(vocab, scores)
    tok = tokenizers.Tokenizer(_bpe(vocab, merges, unk="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", SPIECE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPIECE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, vocab


def _sentencepiece(tokens: list[str], metadata: dict, where: str, prefix: str) -> tuple[tokenizers.Tokenizer, dict]:
    """A SentencePiece BPE vocabulary (Llama, Mistral, Phi-3...): merges stored, or derived from the scores."""
    vocab = _vocab(tokens)
    if metadata.get("tokenizer.ggml.merges") is not None:
        merges = _stored_merges(metadata["tokenizer.ggml.merges"])
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise CheckpointError(f"{where}GGUF SentencePiece vocabulary has neither merges nor one score per token")
        merges = _merges_from_vocab(vocab, dict(zip(tokens, scores, strict=True)))
    tok = tokenizers.Tokenizer(_bpe(vocab, merges, unk=None, byte_fallback=True, fuse_unk=True))
    if prefix == "normalizer":  # Phi-3: the prefix space comes from a normalizer, spaces are not split on
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE), normalizers.Replace(" ", SPIECE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([
        decoders.Replace(SPIECE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    return tok, vocab


def _byte_level(tokens: list[str], metadata: dict, where: str) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """Byte-level BPE (GPT-2, Llama 3, Qwen...): tokens in the byte alphabet, merges stored."""
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = _vocab([t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens])
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise CheckpointError(f"{where}GGUF byte-level (gpt2) tokenizer has no tokenizer.ggml.merges")
    tok = tokenizers.Tokenizer(_bpe(vocab, _stored_merges(merges), unk=None, byte_fallback=False, fuse_unk=False,
                                    affixes=""))
    pattern = SPLIT_PATTERNS.get(metadata.get("tokenizer.ggml.pre"))
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


def _vocab(tokens: list[str]) -> dict[str, int]:
    return {t: i for i, t in enumerate(tokens)}  # a repeated spelling keeps its last id, as transformers does


def _bpe(vocab, merges, *, unk, byte_fallback, fuse_unk, affixes=None) -> BPE:
    kwargs = {"continuing_subword_prefix": affixes, "end_of_word_suffix": affixes} if affixes is not None else {}
    if unk is not None and unk in vocab:
        kwargs["unk_token"] = unk
    return BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=fuse_unk, byte_fallback=byte_fallback, **kwargs)


def _stored_merges(merges) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        left, _, right = m.partition(" ")
        out.append((left, right))
    return out


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) cut of a token into two vocabulary tokens, ranked: higher-scored token first, then
    the longer left part, then the longer right part; ties keep the order the tokens are listed in ``scores``.

    A vocabulary whose scores strictly fall along its order (Gemma's positions) is already ranked, so no sort."""
    has = vocab.__contains__
    ordered = list(scores)
    cuts: list[tuple[str, str]] = []
    extend = cuts.extend
    for tok in ordered:
        n = len(tok)
        if n > 1:
            extend([(tok[:k], tok[k:]) for k in range(n - 1, 0, -1) if has(tok[:k]) and has(tok[k:])])
    values = [scores[t] for t in ordered]
    if all(a > b for a, b in zip(values, values[1:], strict=False)):
        return cuts
    # General case: a stable sort on (score desc, len(left) desc, len(right) desc).
    return sorted(cuts, key=lambda c: (-scores[c[0] + c[1]], -len(c[0]), -len(c[1])))


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values: printable Latin-1 bytes stand for themselves, the
    rest take the code points from 256 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {b: chr(b) for b in printable}
    extra = 256
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(extra)
            extra += 1
    return spelling


# --- post-processing and chat ----------------------------------------------------------------------------------


def _template(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None):
    """BOS/EOS around each sequence, as transformers' ``update_post_processor`` writes it."""
    pre = f"{bos}:0 " if bos else ""
    post = f" {eos}:0" if eos else ""
    single = f"{pre}$A:0{post}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def chat_template_from_metadata(metadata: dict) -> str | dict[str, str] | None:
    """``tokenizer.chat_template``, plus llama.cpp's named ones (``tokenizer.chat_template.<name>``) as a dict."""
    default = metadata.get("tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = {k[len(prefix):]: v for k, v in metadata.items() if k.startswith(prefix) and isinstance(v, str)}
    if not named:
        return default if isinstance(default, str) else None
    if isinstance(default, str):
        named = {"default": default, **named}
    return named
