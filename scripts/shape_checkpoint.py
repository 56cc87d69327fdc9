"""A checkpoint with a real model's tensor names, shapes and dtypes but no data: for planning tests (what fits
where) of models far too big to build. The safetensors file is sparse (its header, then a hole of the data's
size), so a 35B checkpoint takes kilobytes of disk; reading a tensor gives zeros. Dev tool: needs torch and
transformers (the model is instantiated on the meta device to list its parameters).

    python scripts/shape_checkpoint.py OUT [--shape qwen3.5-35b-a3b] [--layers N] [--format bf16|fp8|nvfp4]

fp8 / nvfp4: the layout ``lumen quantize`` writes (the same rules decide what is quantized and the same
``quantization_config``), also without data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# transformers' defaults are this model's shape, but for its trained context: the published config says 262144
SHAPES = {"qwen3.5-35b-a3b": ("Qwen3_5MoeTextConfig", {"max_position_embeddings": 262144})}


def _parameters(config) -> dict[str, tuple[int, ...]]:
    """Name -> shape as save_pretrained writes them (fused expert tensors split per expert)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):  # (E, 2I, H) -> per expert gate (I, H), up (I, H)
            E, I2, H = t.shape
            for e in range(E):
                for part in ("gate_proj", "up_proj"):
                    out[f"{name.removesuffix('gate_up_proj')}{e}.{part}.weight"] = (I2 // 2, H)
        elif name.endswith("mlp.experts.down_proj"):  # (E, H, I)
            E, H, I = t.shape
            for e in range(E):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = (H, I)
        else:
            out[name] = tuple(t.shape)
    return out


def _sparse(path: Path, header: bytes, nbytes: int) -> None:
    with open(path, "wb") as f:
        f.write(header)
    os.truncate(path, len(header) + nbytes)


def write(out: Path, shape: str = "qwen3.5-35b-a3b", layers: int | None = None, fmt: str = "bf16") -> Path:
    import transformers

    from lumen_core.quantize import layout, shard_header

    cls, overrides = SHAPES[shape]
    config = getattr(transformers, cls)(**overrides, **({"num_hidden_layers": layers} if layers else {}))
    src = Path(out) / "bf16" if fmt != "bf16" else Path(out)
    src.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(src)
    tensors = [(n, "BF16", s, 2 * _count(s)) for n, s in _parameters(config).items()]
    _sparse(src / "model.safetensors", shard_header(tensors), sum(t[3] for t in tensors))
    if fmt == "bf16":
        return src
    from lumen_core.checkpoint.hf import HFCheckpoint

    dst = Path(out) / fmt
    dst.mkdir(parents=True, exist_ok=True)
    ckpt = HFCheckpoint(src)
    tensors, quant_config = layout(ckpt, fmt)
    _sparse(dst / "model.safetensors", shard_header(tensors), sum(t[3] for t in tensors))
    cfg = dict(ckpt.config)
    cfg["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--shape", default="qwen3.5-35b-a3b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    p.add_argument("--format", default="bf16", choices=["bf16", "fp8", "nvfp4"])
    args = p.parse_args()
    print(write(Path(args.out), args.shape, args.layers, args.format), file=sys.stderr)


if __name__ == "__main__":
    main()
