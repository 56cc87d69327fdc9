"""How ``gemv.linear_group`` turns a projection group into as few matrices as it can. The array module is an
argument (CuPy on the GPU, numpy in the CPU tests: tests/test_cuda_fuse_plan.py checks the layout against a
dequantization of each member).

Members fuse where they share a format, K, scale layout and activations (``fuse_key``). By default a group is one
matrix only where all of it agrees in whole scale blocks (as before the twenty-sixth session); with
``LUMEN_CUDA_PARTIAL_FUSION=1`` a group whose members do not all agree still fuses each agreeing set (fp8 qkv and z
beside a bf16 b and a: two launches, not four), and fp8 members are padded to whole blocks: the scale of row r is
row r // block rows of the stacked scales, so a member whose rows are not a multiple of the block is followed by
zero rows up to the next block (the fp8 qkv, z, b, a of 8192, 4096, 32, 32 rows: b padded by 96 rows, one launch
of 12448 rows where there were four).
"""

from __future__ import annotations

import os

from lumen_core.backend import Weight


def fuse_key(w):
    """What members of a projection group must share to be one matrix (format, K, activations, fp8 block), or None
    where ``w`` is never fused (nvfp4: a global scale per matrix; GGUF blocks; a per-tensor fp8 scale; data that
    is not one C-contiguous 2-d array)."""
    if len(w.shape) != 2 or w.data.ndim != 2 or not w.data.flags.c_contiguous:
        return None
    if w.format in ("f32", "bf16", "f16"):
        return None if w.scale is not None else (w.format, w.shape[-1], w.activations, None)
    if w.format == "fp8":  # per-channel scales, or 2-d block scales
        if w.scale is None:
            return None
        if w.block is None:
            return ("fp8", w.shape[-1], w.activations, None) if w.scale.size == w.shape[0] else None
        return ("fp8", w.shape[-1], w.activations, tuple(w.block)) if w.scale.ndim == 2 else None
    return None


def fuse_plan(keys, rows, block_rows) -> list[tuple[list[int], list[int], int]]:
    """The parts of a group whose members have fuse keys ``keys`` (None: alone) and ``rows`` rows, with
    ``block_rows[key]`` rows a scale block (1: none): -> [(members, first rows, total rows)] in the order of each
    part's first member. A part holds every member of one key, in group order, each starting at a multiple of the
    block rows; the last is not padded."""
    parts: dict = {}
    for i, k in enumerate(keys):
        parts.setdefault(("alone", i) if k is None else k, []).append(i)
    plan = []
    for k, members in parts.items():
        br = 1 if k[0] == "alone" else block_rows[k]
        starts, r = [], 0
        for i in members:
            starts.append(r)
            r += -(-rows[i] // br) * br
        plan.append((members, starts, starts[-1] + rows[members[-1]]))
    return plan


def fuse(ws, starts, total, xp) -> Weight:
    """One Weight of ``total`` rows holding each of ``ws`` from its row in ``starts`` (zero rows between, arrays of
    ``xp``); each w.data (and fp8 scale) becomes a view into it, so the separate buffers are freed and the matrices
    live once. (A cache of a member's device pointers must check them: moe._table does.)"""
    w0 = ws[0]
    br = 1 if w0.block is None else w0.block[0]
    data = xp.zeros((total, w0.data.shape[1]), w0.data.dtype)
    for w, r in zip(ws, starts, strict=True):
        data[r:r + w.shape[0]] = w.data
    scale = None
    if w0.format == "fp8":
        parts = [w.scale.reshape(w.shape[0], 1) if w0.block is None else w.scale for w in ws]
        scale = xp.zeros((-(-total // br), parts[0].shape[1]), parts[0].dtype)
        for r, sc in zip(starts, parts, strict=True):
            scale[r // br:r // br + sc.shape[0]] = sc
    fused = Weight(data, w0.format, (total, w0.shape[-1]), scale, w0.block, store="vram", activations=w0.activations)
    for w, r in zip(ws, starts, strict=True):
        n = w.shape[0]
        w.data = data[r:r + n]
        if scale is not None:
            sr = scale[r // br:r // br + -(-n // br)]
            w.scale = sr if w0.block is not None else sr.reshape(w.scale.shape)
    return fused


def fuse_group(ws, xp, partial: bool = True) -> list[tuple[Weight | None, list[tuple[int, int, int]]]]:
    """The parts of the projection group ``ws``: [(fused Weight, or None for a member alone, [(member index, first
    row, rows)])]. Fuses (``fuse``) every part of two or more members; a member alone is not referenced (the list
    is kept on ws[0]). ``partial`` False: the whole group as one matrix where every member has the same key and
    whole scale blocks, else every member alone (what linear_group did before partial groups and padding)."""
    keys = [fuse_key(w) for w in ws]
    block_rows = {k: (1 if k[3] is None else k[3][0]) for k in keys if k is not None}
    rows = [w.shape[0] for w in ws]
    plan = fuse_plan(keys, rows, block_rows)
    if not partial and not (len(plan) == 1 and keys[0] is not None
                            and all(n % block_rows[keys[0]] == 0 for n in rows)):
        plan = [([i], [0], n) for i, n in enumerate(rows)]
    parts = []
    for members, starts, total in plan:
        if len(members) == 1:
            parts.append((None, [(members[0], 0, ws[members[0]].shape[0])]))
        else:
            fused = fuse([ws[i] for i in members], starts, total, xp)
            parts.append((fused, [(i, r, ws[i].shape[0]) for i, r in zip(members, starts, strict=True)]))
    return parts


def partial_fusion(env=None) -> bool:
    """``LUMEN_CUDA_PARTIAL_FUSION``: 1 fuses the agreeing members of a projection group even where others differ,
    fp8 members padded to whole scale blocks (``fuse_plan``: the Gated-DeltaNet's qkv, z, b, a in one launch); unset
    or 0 (the default until a GPU suite has run on it), a group is one matrix only where all of it agrees in whole
    blocks. Read when a group is first fused; anything else is an error naming it."""
    v = (os.environ if env is None else env).get("LUMEN_CUDA_PARTIAL_FUSION", "")
    if v not in ("", "0", "1"):
        raise ValueError(f"LUMEN_CUDA_PARTIAL_FUSION={v!r}: use 1 (fuse each agreeing part of a projection group) or "
                         "0 (whole groups only, the default)")
    return v == "1"
