"""Make the tiny GGUF test fixtures under tests/data/gguf/ (dev tool: torch, transformers, llama-cpp-python).

    python scripts/make_gguf_fixtures.py [--llama-cpp DIR] [--out tests/data/gguf] [NAME ...]

For each fixture: a tiny random HF checkpoint from `scripts/make_tiny_checkpoint.py`, converted by llama.cpp's
own converter (`convert_hf_to_gguf.py`, run in a subprocess with its vendored `gguf-py` first on sys.path) to
F32, F16 and Q8_0, and the F32 file quantized to Q4_K_M by llama.cpp's quantizer
(`llama_cpp.llama_model_quantize`). The HF directory is kept beside the GGUF files, its weights re-saved in
bf16 (compact; the tests compare against the GGUF's own weights, or the HF directory at 1e-5 against the F32
GGUF converted from these same bf16 values).

`--llama-cpp` is a llama.cpp source tree; the default is the one vendored in the llama-cpp-python sdist
(`pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36` and unpack it), the same version as the
installed quantizer.

One patch to the converter, made in the subprocess only: its BPE pre-tokenizer check hashes the ids of a test
string and refuses a tokenizer it does not know. Our tiny tokenizer is trained on a small corpus, so its ids
(and hash) are our own; `get_vocab_base_pre` is replaced by one returning the name llama.cpp writes for the real
model family (`qwen35` for Qwen 3.5, whose split regex the tiny tokenizer copies). Gemma 4 takes another vocab
path (`gemma4`, no pre-tokenizer hash). Everything else runs as llama.cpp ships it.

Gemma 4's converter reads the vocabulary with `gguf.LlamaHfVocab`, which takes only a SentencePiece-style BPE
(byte fallback, a `Sequence` decoder), as the real Gemma 4 tokenizer is; `make_tiny_checkpoint`'s Gemma kinds
get a byte-level BPE. So for the gemma4 fixtures this script swaps in a Gemma-style tokenizer trained on the same
corpus with the same special tokens: `Replace(" ", "▁")` normalizer, BPE with byte fallback (`<0x00>`..`<0xFF>`
first in the vocabulary), decoder Replace/ByteFallback/Fuse, `<bos>` prepended — the pipeline transformers'
`GemmaTokenizer` builds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
DEFAULT_LLAMA_CPP = Path("/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")

MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
E2B = {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True}

# name -> (make_tiny_checkpoint kind, overrides, pre-tokenizer name for the converter patch or None).
# Small enough to commit (hidden size 32, 2-4 layers), yet some rows are 256 wide so that Q4_K_M holds
# K-quant blocks: intermediate sizes of 256 let the down projections (dense, shared and routed experts) be
# K-quantized; llama.cpp falls back to Q5_0 / Q8_0 for the 32-wide rows (the README lists each file's types).
SMALL = {"hidden_size": 32}
QWEN_TWO_LAYERS = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
FIXTURES = {
    "qwen35": ("qwen3_5", {**SMALL, **QWEN_TWO_LAYERS, "intermediate_size": 256}, "qwen35"),
    "qwen35moe": ("qwen3_5_moe", {**SMALL, **QWEN_TWO_LAYERS, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 256, "shared_expert_intermediate_size": 64,
                                  "tie_word_embeddings": True}, "qwen35"),
    "gemma4-dense": ("gemma4", {**SMALL, "intermediate_size": 256}, None),
    "gemma4-moe": ("gemma4", {**SMALL, **MOE, "num_hidden_layers": 2,
                              "layer_types": ["sliding_attention", "full_attention"],
                              "intermediate_size": 64, "moe_intermediate_size": 256}, None),
    "gemma4-e2b": ("gemma4", {**SMALL, **E2B, "intermediate_size": 128}, None),
}

CONVERT_TYPES = ("f32", "f16", "q8_0")

# Runs in the subprocess: the vendored converter with its own gguf-py, the pre-tokenizer check patched.
_RUNNER = """
import sys
llama_cpp, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, llama_cpp + "/gguf-py")
sys.path.insert(0, llama_cpp)
import convert_hf_to_gguf
from conversion.base import TextModel
if pre != "-":
    TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[3:]
convert_hf_to_gguf.main()
"""


def convert(llama_cpp: Path, hf_dir: Path, out: Path, outtype: str, pre: str | None) -> None:
    env = {**os.environ, "NO_LOCAL_GGUF": "1"}  # gguf-py goes on sys.path by the runner, first
    cmd = [sys.executable, "-c", _RUNNER, str(llama_cpp), pre or "-", str(hf_dir), "--outfile", str(out),
           "--outtype", outtype]
    if pre == "qwen35":
        cmd.append("--no-mtp")  # the tiny checkpoint has no MTP block; without it the converter asserts one
    subprocess.run(cmd, check=True, env=env, cwd=llama_cpp)


def quantize(src: Path, out: Path, ftype_name: str = "LLAMA_FTYPE_MOSTLY_Q4_K_M") -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {out}) returned {rc}")


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type a GGUF file holds (read with the installed gguf package)."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def save_compact(hf_dir: Path) -> None:
    """Re-save the HF weights in bf16 (the fixtures are converted from these same bf16-representable values)."""
    from safetensors.torch import load_file, save_file

    for f in hf_dir.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v.to(__import__("torch").bfloat16).contiguous() for k, v in tensors.items()}, f,
                  metadata={"format": "pt"})
    cfg_path = hf_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def round_to_bf16(hf_dir: Path) -> None:
    """Round every weight to a bf16 value, kept in f32: what the converter reads equals the committed bf16."""
    import torch
    from safetensors.torch import load_file, save_file

    for f in hf_dir.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v.to(torch.bfloat16).to(torch.float32).contiguous() for k, v in tensors.items()}, f,
                  metadata={"format": "pt"})


def gemma_sp_tokenizer(special: tuple[str, ...]):
    """A SentencePiece-style BPE with byte fallback (Gemma's pipeline) trained on make_tiny_checkpoint's corpus."""
    from make_tiny_checkpoint import CORPUS, MODEL_VOCAB
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    def pipeline(tok: Tokenizer) -> Tokenizer:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        return tok

    lines = [line for line in CORPUS.splitlines() if line]
    trained = pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(vocab_size=MODEL_VOCAB - 24 - 256, initial_alphabet=["\n"], show_progress=False)
    trained.train_from_iterator(lines, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    tok = pipeline(Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
                                        unk_token="<unk>")))
    tok.add_special_tokens(list(special))
    assert tok.get_vocab_size() <= MODEL_VOCAB, tok.get_vocab_size()
    return tok


def save_gemma_sp_tokenizer(tok, out: Path, kind: str, token_ids: dict[str, int]) -> None:
    """make_tiny_checkpoint.save_gemma_tokenizer without its byte-level post-processor."""
    import make_tiny_checkpoint as mtc
    import transformers
    from tokenizers import processors

    bos = token_ids["<bos>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        add_bos_token=True, chat_template=mtc.read_template("gemma4.jinja"),
    )
    fast.save_pretrained(out)
    gen = {"bos_token_id": bos, "eos_token_id": [token_ids["<eos>"], token_ids["<turn|>"]],
           "pad_token_id": token_ids["<pad>"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")


def make_hf(kind: str, out: Path, overrides: dict) -> None:
    import make_tiny_checkpoint as mtc

    if not kind.startswith("gemma4"):
        mtc.make(kind, out, seed=0, **overrides)
        return
    saved = mtc.build_tokenizer, mtc.save_gemma_tokenizer
    mtc.build_tokenizer, mtc.save_gemma_tokenizer = gemma_sp_tokenizer, save_gemma_sp_tokenizer
    try:
        mtc.make(kind, out, seed=0, **overrides)
    finally:
        mtc.build_tokenizer, mtc.save_gemma_tokenizer = saved


def make_fixture(name: str, out_root: Path, llama_cpp: Path) -> dict:
    kind, overrides, pre = FIXTURES[name]
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    hf = out / "hf"
    make_hf(kind, hf, overrides)
    round_to_bf16(hf)
    files: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for outtype in CONVERT_TYPES:
        target = out / f"{name}-{outtype}.gguf"
        try:
            convert(llama_cpp, hf, target, outtype, pre)
            files[target.name] = tensor_types(target)
        except subprocess.CalledProcessError as exc:
            errors[target.name] = f"converter failed ({exc.returncode})"
    f32 = out / f"{name}-f32.gguf"
    if f32.exists():
        target = out / f"{name}-q4_k_m.gguf"
        with tempfile.TemporaryDirectory():
            quantize(f32, target)
        files[target.name] = tensor_types(target)
    save_compact(hf)
    return {"kind": kind, "overrides": overrides, "pre_tokenizer_patch": pre, "files": files, "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", choices=[[], *FIXTURES], default=[])
    parser.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA_CPP)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "gguf")
    args = parser.parse_args()
    names = args.names or list(FIXTURES)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for name in names:
        manifest[name] = make_fixture(name, args.out, args.llama_cpp)
        print(name, json.dumps(manifest[name]["files"]), manifest[name]["errors"] or "", flush=True)
    manifest_path.write_text(json.dumps(dict(sorted(manifest.items())), indent=2) + "\n")


if __name__ == "__main__":
    main()
