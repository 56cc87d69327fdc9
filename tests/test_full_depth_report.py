"""benchmarks/cuda_models.py's full-depth report on the CPU (no GPU, no cupy): issue 21's table with each row against
its goals, from rows as a run stores them (``--json``) and merged from several runs' files (``--table``), since one
device call cannot always hold every row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cuda_models as cm  # noqa: E402


def row(layers, real, decode, bytes_per_token, bw, prefill, placement="vram", at_real=None, layer_bytes=1e8,
        decode_at_real=None, **extra):
    return {"layers": layers, "real_layers": real, "placement": placement, "bytes_per_token": bytes_per_token,
            "active_params": 3e9, "decode": decode, "decode_layer_us": 100.0, "decode_outside_us": 300.0,
            "decode_at_real": decode_at_real or decode, "layer_bytes": layer_bytes, "graph": True,
            "expert_bytes_per_token": 1e9, "host_read_bandwidth": None, "read_bandwidth": bw,
            "prefill": {n: {"tok_s": t, "layer_ms": 1.0, "outside_ms": 2.0, "at_real": (at_real or {}).get(n, t)}
                        for n, t in prefill.items()}, **extra}


def test_rows_against_their_goals():
    rows = {
        # 60% of the bound exactly: met; prefill 6600 >= 6500: met
        "35b-a3b-fp8": row(40, 40, 0.6 * 3e12 / 3e9, 3e9, 3e12, {512: 6600}),
        # 9B bf16 measured at 16 layers: the goals take the real depth's fitted figures and bytes
        "9b-bf16": row(16, 32, 300.0, 9e9, 4.4e12, {512: 20000, 4096: 22000}, at_real={512: 11000, 4096: 12500},
                       layer_bytes=0.25e9, decode_at_real=180.0),
        "g4-26b-a4b-bf16": row(30, 30, 100.0, 8e9, 3e12, {512: 7500}),
    }
    text = cm.full_depth_report(rows, [512, 4096])
    lines = {ln.split(":")[0][2:]: ln for ln in text.splitlines() if ln.startswith("- ")}
    assert "decode 60.0% of the bound (goal 60%: met)" in lines["35b-a3b-fp8"]
    assert "prefill 512 6600 tok/s (goal 6500: met)" in lines["35b-a3b-fp8"]
    frac = 180.0 * (9e9 + 16 * 0.25e9) / 4.4e12  # the real depth's decode and bytes
    assert f"decode {frac:.1%} of the bound (goal 85%: {frac / 0.85:.0%} of it)" in lines["9b-bf16"]
    assert "prefill 4096 12500 tok/s (goal 25000: 50% of it)" in lines["9b-bf16"]
    assert "prefill 512 7500 tok/s (goal 15000: 50% of it)" in lines["g4-26b-a4b-bf16"]
    assert "| 9b-bf16 | 16 | 300.0 |" in text and "9b-bf16 at its real 32 layers" in text
    assert "| g4-26b-a4b-bf16 | 30 | 100.0 |" in text and "| - | - | - | - | - | - |" in text  # no 4096 run
    assert "read bandwidth measured: 3000, 4400 GB/s" in text


def test_cpu_experts_rows_against_issue_22():
    r = row(40, 40, 58.8, 3e9, 3e12, {512: 624}, placement="cpu-experts", host_read_bandwidth=109.4e9)
    text = cm.full_depth_report({"35b-a3b-fp8": r}, [512])
    assert "decode 58.8 tok/s = 1.58x llama.cpp (goal 1.5x: met)" in text
    assert "prefill 512 624 tok/s = 5.38x (goal 1.5x: met)" in text
    assert "of host" in text and "109.4 GB/s" in text
    slow = row(40, 40, 44.3, 3e9, 3e12, {512: 168}, placement="cpu-experts")
    text = cm.full_depth_report({"35b-a3b-fp8": slow}, [512])
    assert "= 1.19x llama.cpp (goal 1.5x: 80% of it)" in text and "= 1.45x (goal 1.5x: 97% of it)" in text
    with pytest.raises(SystemExit, match="one placement"):
        cm.full_depth_report({"35b-a3b-fp8": r, "35b-a3b-nvfp4": row(40, 40, 1.0, 1, 1, {512: 1})}, [512])


def test_table_merges_the_json_of_separate_runs(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    old = row(40, 40, 227.7, 3.48e9, 3.01e12, {512: 6397})
    del old["read_bandwidth"]  # files before the row kept its own: the file's
    a.write_text(json.dumps({"bandwidth": 3.01e12, "full_depth": {"35b-a3b-fp8": old}}))
    b.write_text(json.dumps({"bandwidth": 3.0e12, "full_depth": {
        "g4-26b-a4b-bf16": row(30, 30, 178.9, 7.85e9, 3.016e12, {512: 7816})}}))
    cm.main(["--table", f"{a},{b}"])
    out = capsys.readouterr().out
    assert "| 35b-a3b-fp8 | 40 | 227.7 | 26.3% |" in out and "| g4-26b-a4b-bf16 | 30 | 178.9 | 46.6% |" in out
    assert "prefill 512 6397 tok/s (goal 6500: 98% of it)" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": {}}))
    with pytest.raises(SystemExit, match="bad.json: not a --full-depth --json file"):
        cm.main(["--table", str(bad)])


def test_a_bf16_activations_row_keeps_its_models_goals_and_llama_cpp_figures():
    """--cuda-compute bf16 names a row "MODEL bf16-act": it sits beside the exact row, against the same goals."""
    rows = {"9b-bf16": row(32, 32, 180.0, 18e9, 4.4e12, {4096: 11000}),
            "9b-bf16 bf16-act": row(32, 32, 180.0, 18e9, 4.4e12, {4096: 26000})}
    text = cm.full_depth_report(rows, [4096])
    lines = {ln.split(":")[0][2:]: ln for ln in text.splitlines() if ln.startswith("- ")}
    assert "prefill 4096 26000 tok/s (goal 25000: met)" in lines["9b-bf16 bf16-act"]
    assert "prefill 4096 11000 tok/s (goal 25000: 44% of it)" in lines["9b-bf16"]
    assert f"| {26000 / cm.LLAMA_CPP['9b-bf16'][1][4096]:.2f}x |" in text
