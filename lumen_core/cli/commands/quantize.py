"""``lumen quantize``: write an FP8 (HF block layout) or NVFP4 (ModelOpt layout) copy of an HF checkpoint."""

from __future__ import annotations

import sys
from typing import Annotated

import typer


def quantize(
    input: Annotated[str, typer.Option("--input", "-i", help="HF checkpoint directory (f32/bf16/f16 safetensors).")],
    output: Annotated[str, typer.Option("--output", "-o", help="Directory to write the quantized checkpoint to.")],
    format: Annotated[str, typer.Option("--format", help="fp8 (e4m3, block scales) or nvfp4 (ModelOpt).")],
    block: Annotated[int, typer.Option("--block", help="fp8 scale block: one scale per BLOCK×BLOCK tile.")] = 128,
    skip: Annotated[str | None, typer.Option("--skip", help="Regex: matching tensors stay unquantized.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Write into an existing, non-empty --output.")] = False,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Split files above this (e.g. 5GB).")]
    = "5GB",
):
    """Quantize the weights the architecture feeds to `linear` and write a new checkpoint.

    Embeddings, norms, the lm_head and MoE routers stay in their checkpoint type (and anything --skip matches).
    fp8 writes `X.weight` F8_E4M3 + `X.weight_scale_inv` F32 per BLOCK×BLOCK tile; nvfp4 writes `X.weight` U8
    (two E2M1 values a byte) + `X.weight_scale` F8_E4M3 per 16 values + `X.weight_scale_2` F32. config.json
    gets the matching `quantization_config`; tokenizer files are copied. Tensors are processed one at a time.
    """
    from ...quantize import parse_size, quantize_checkpoint

    result = quantize_checkpoint(input, output, format.lower(), block=block, skip=skip, force=force,
                                 max_shard_bytes=parse_size(max_shard_size), progress=sys.stderr.isatty())
    typer.echo(result.summary(), err=True)


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)
