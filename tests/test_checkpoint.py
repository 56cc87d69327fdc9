"""Checkpoint reading: lazy safetensors, shards, formats (f32/bf16/fp8), and every error a user can hit."""

from __future__ import annotations

import json
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import lumen_core as lumen
from lumen_core.checkpoint.safetensors import SafetensorsFile
from lumen_core.errors import CheckpointError, PluginError

PROMPT = list(range(5, 45))


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def logits_of(path, ids=PROMPT, **model):
    engine = lumen.load({"model": {"path": str(path), **model}}, progress=False)
    return engine, engine.model.forward(ids, engine.model.new_cache(64), all_logits=True)


def rewrite_tensors(path, fn):
    """Load model.safetensors as numpy (bf16/fp8 via raw bytes are not needed here), apply fn, save."""
    tensors = load_file(str(path / "model.safetensors"))
    save_file(fn(tensors), str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        lumen.load({"model": {"path": str(tmp_path / "nope")}})


def test_a_path_too_long_for_the_system_is_a_checkpoint_error():
    """Path.exists() raises OSError (ENAMETOOLONG) for a 5000-character name; the error shows the path shortened."""
    with pytest.raises(CheckpointError, match=r"model\.path cannot be looked up \(File name too long\): "
                                              r"[^ ]{50,}m\.\.\. \(50\d\d characters\)$"):
        lumen.load({"model": {"path": "m" * 5000}})  # made absolute against the working directory


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        lumen.load({"model": {"path": str(tmp_path)}})


def test_directory_without_weights(tmp_path, tiny_checkpoint):
    (tmp_path / "config.json").write_text((tiny_checkpoint("qwen3_5") / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        lumen.load({"model": {"path": str(tmp_path)}})


def test_corrupt_config_json(tmp_path, tiny_checkpoint):
    path = copy_ckpt(tiny_checkpoint("qwen3_5"), tmp_path / "c")
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt JSON.*config.json"):
        lumen.load({"model": {"path": str(path)}})


def test_truncated_safetensors(tmp_path, tiny_checkpoint):
    path = copy_ckpt(tiny_checkpoint("qwen3_5"), tmp_path / "c")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        lumen.load({"model": {"path": str(path)}})


def test_garbage_safetensors_header(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 12) + b"not json!!!!")
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        SafetensorsFile(f)


def test_json_nested_too_deeply_is_a_checkpoint_error(tmp_path, tiny_checkpoint):
    """json recurses once per level: 5000 levels in config.json or a safetensors header was a RecursionError."""
    path = copy_ckpt(tiny_checkpoint("qwen3_5"), tmp_path / "c")
    (path / "config.json").write_text('{"model_type": "qwen3_5", "x": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(CheckpointError, match=r"corrupt JSON in .*config\.json: .*nested too deeply"):
        lumen.load({"model": {"path": str(path)}})
    header = b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    f = tmp_path / "deep.safetensors"
    f.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match=r"deep\.safetensors: corrupt safetensors header \(JSON nested too "):
        SafetensorsFile(f)


def test_missing_tensor_is_named(tmp_path, tiny_checkpoint):
    path = copy_ckpt(tiny_checkpoint("qwen3_5"), tmp_path / "c")
    victim = "model.layers.3.self_attn.k_norm.weight"
    rewrite_tensors(path, lambda t: {k: v for k, v in t.items() if k != victim})
    with pytest.raises(CheckpointError, match=f"missing: {victim}"):
        lumen.load({"model": {"path": str(path)}})


def test_unused_tensor_is_reported(tmp_path, tiny_checkpoint, capsys):
    path = copy_ckpt(tiny_checkpoint("qwen3_5"), tmp_path / "c")
    rewrite_tensors(path, lambda t: {**t, "model.extra.weight": np.zeros((2, 2), np.float32)})
    engine = lumen.load({"model": {"path": str(path)}}, progress=False)
    assert engine.report.unused == ["model.extra.weight"]
    assert "model.extra.weight" in capsys.readouterr().err


def test_unknown_model_type_lists_installed(tmp_path, tiny_checkpoint):
    path = copy_ckpt(tiny_checkpoint("qwen3_5"), tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "nemotron_h"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PluginError, match="'nemotron_h'.*installed: .*qwen3_5.*no known plugin provides it"):
        lumen.load({"model": {"path": str(path)}})


def test_unknown_model_type_names_the_plugin_to_install(tmp_path, tiny_checkpoint, monkeypatch):
    from lumen_core import plugins

    path = copy_ckpt(tiny_checkpoint("qwen3_5"), tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gemma4_text"
    (path / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("LUMEN_LOAD_PLUGINS", "core,cpu,qwen")
    plugins.reset()
    try:
        with pytest.raises(PluginError, match="'gemma4_text'.*pip install lumen-models-gemma"):
            lumen.load({"model": {"path": str(path)}})
    finally:
        monkeypatch.delenv("LUMEN_LOAD_PLUGINS")
        plugins.reset()


def test_sharded_checkpoint_equals_single_file(tmp_path, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoint("qwen3_5")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    _, ours = logits_of(tmp_path / "sharded")
    _, single = logits_of(src)
    assert np.array_equal(ours, single)


def test_missing_shard_is_named(tmp_path, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3_5"), dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    victim = sorted((tmp_path / "sharded").glob("*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"missing.*{victim.name}"):
        lumen.load({"model": {"path": str(tmp_path / "sharded")}})


def test_bf16_checkpoint_keeps_bf16_storage(tmp_path, tiny_checkpoint):
    """bf16 weights are stored as bf16 and computed in f32: equal to f32 weights rounded to bf16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3_5"), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model.to(torch.bfloat16).to(torch.float32).save_pretrained(tmp_path / "rounded")
    engine, ours = logits_of(tmp_path / "bf16")
    _, rounded = logits_of(tmp_path / "rounded")
    head = engine.model.layers[0].mixer.qkv
    assert head.format == "bf16" and head.data.dtype == ml_dtypes.bfloat16
    assert np.abs(ours - rounded).max() <= 1e-5


def quantize_fp8(w: np.ndarray, block: int):
    """HF FP8 layout: e4m3 values and a float32 ``weight_scale_inv`` per (block × block) tile."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    scale = np.zeros((rows, cols), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = max(np.abs(tile).max() / 448.0, 1e-12)
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def write_fp8(src, dst, block: int, per_channel: bool = False):
    """An FP8 copy of ``src`` (block or per-channel scales) and an f32 copy holding the dequantized values."""
    tensors = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and "embed" not in name and "lm_head" not in name:
            q, s = quantize_fp8(w, w.shape[0] if per_channel else block) if not per_channel else \
                _per_channel(w)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = _dequant(q, s, block, per_channel)
        else:
            fp8[name] = deq[name] = w
    for d, t in ((dst / "fp8", fp8), (dst / "deq", deq)):
        shutil.copytree(src, d)
        _save_raw(t, d / "model.safetensors")
    return dst / "fp8", dst / "deq"


def _per_channel(w):
    s = np.maximum(np.abs(w).max(axis=1, keepdims=True) / 448.0, 1e-12).astype(np.float32)
    return (w / s).astype(ml_dtypes.float8_e4m3fn), s


def _dequant(q, s, block, per_channel):
    x = q.astype(np.float32)
    if per_channel:
        return x * s
    big = np.repeat(np.repeat(s, block, 0), block, 1)[: x.shape[0], : x.shape[1]]
    return x * big


def _save_raw(tensors: dict, path):
    """Write safetensors by hand: safetensors.numpy cannot store ml_dtypes' float8."""
    names = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        end = offset + len(raw)
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, end]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


@pytest.mark.parametrize("per_channel", [False, True], ids=["block32", "per-channel"])
def test_fp8_checkpoint_matches_its_dequantized_weights(tmp_path, tiny_checkpoint, per_channel):
    fp8, deq = write_fp8(tiny_checkpoint("qwen3_5_moe"), tmp_path, block=32, per_channel=per_channel)
    engine, ours = logits_of(fp8)
    _, ref = logits_of(deq)
    w = engine.model.layers[0].mixer.qkv
    assert w.format == "fp8" and w.data.dtype == ml_dtypes.float8_e4m3fn
    assert (w.block == (32, 32)) != per_channel
    assert np.abs(ours - ref).max() <= 1e-5


def test_mmap_store_matches_ram(tiny_checkpoint):
    _, ram = logits_of(tiny_checkpoint("qwen3_5_moe"), store="ram")
    engine, mm = logits_of(tiny_checkpoint("qwen3_5_moe"), store="mmap")
    assert isinstance(engine.model.layers[0].mixer.qkv.data, np.ndarray)
    assert not engine.model.layers[0].mixer.qkv.data.flags.owndata  # a view on the mapped file
    assert np.array_equal(ram, mm)
