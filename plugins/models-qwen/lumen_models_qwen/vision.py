"""The Qwen 3.5 vision tower (Qwen3-VL's ViT, without deepstack): patches -> ViT blocks -> patch merger -> the
text model's hidden size. Written against the op contract, like the text model; one image at a time, so attention
never crosses images (and within an image, never crosses frames, as transformers' ``cu_seqlens``).

The input is what transformers' processor gives (``ImageInput.pixels``: ``(t*h*w, C*T*P*P)``, patches in
spatial-merge-block order: each run of ``merge²`` consecutive patches is one merged token; ``grid``: ``(t, h, w)``
in patches):

- patch embedding: a Conv3d with kernel = stride = (T, P, P), i.e. a linear on the flattened patch;
- learned position embeddings (a square ``side × side`` table) resampled to the image's grid, bilinear with
  ``align_corners=True`` (4 taps a patch, weighted);
- 2D rotary: a quarter of each head's dims rotates with the patch row, a quarter with its column, the pairing
  rotate-half over the whole head (as ``rope_tables`` builds M-RoPE tables over (row, column, -) positions);
- blocks: pre-LayerNorm, bidirectional attention (qkv with bias), LayerNorm, MLP (GELU tanh);
- merger: LayerNorm, each ``merge²`` patches concatenated, linear, GELU (erf), linear to ``out_hidden_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lumen_core.architecture import ConfigValueError, read_float, read_int
from lumen_core.backend import Weight
from lumen_core.errors import CheckpointError

LN_EPS = 1e-6  # transformers' Qwen3.5 vision LayerNorms
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}
PREFIXES = ("model.visual.", "visual.")
BLOCK_TENSORS = ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attn.qkv.weight", "attn.qkv.bias",
                 "attn.proj.weight", "attn.proj.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                 "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
TOWER_TENSORS = ("patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight", "merger.norm.weight",
                 "merger.norm.bias", "merger.linear_fc1.weight", "merger.linear_fc1.bias", "merger.linear_fc2.weight",
                 "merger.linear_fc2.bias")
# fed to ``linear`` / ``embedding`` (kept in the checkpoint's format); the rest are f32 tensors (norms, biases, and
# the 5-D patch-embedding kernel, which the tower flattens into an f32 matrix)
MATRICES = ("attn.qkv.weight", "attn.proj.weight", "linear_fc1.weight", "linear_fc2.weight", "pos_embed.weight")
OPS = {"linear", "embedding", "layer_norm", "gelu", "gelu_tanh", "rope_tables", "apply_rope",
       "bidirectional_attention", "concat"}


@dataclass
class VisionArgs:
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, vc: dict) -> VisionArgs:
        """``vision_config`` read typed (errors name ``vision_config.<key>``); absent keys take transformers'
        defaults."""
        args, label = cls(), "vision_config."
        for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                    "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings"):
            setattr(args, key, read_int(vc, key, 1, getattr(args, key), label=label + key))
        act = vc.get("hidden_act", args.hidden_act)
        if act not in ACTIVATIONS:
            raise ConfigValueError(label + "hidden_act", f"is {act!r}; the Qwen vision tower runs "
                                   f"{', '.join(map(repr, ACTIVATIONS))}")
        args.hidden_act = act
        rope = vc.get("rope_parameters") or {}
        args.rope_theta = read_float(rope, "rope_theta", vc.get("rope_theta", 10000.0),
                                     label=label + "rope_parameters.rope_theta")
        if args.hidden_size % args.num_heads or (args.hidden_size // args.num_heads) % 4:
            raise ConfigValueError(label + "num_heads", f"must split hidden_size ({args.hidden_size}) into heads of "
                                   f"a multiple of 4 dims (2D rotary); it is {args.num_heads}")
        side = int(round(args.num_position_embeddings ** 0.5))
        if side * side != args.num_position_embeddings:
            raise ConfigValueError(label + "num_position_embeddings", "must be a square (a side × side grid of "
                                   f"learned positions); it is {args.num_position_embeddings}")
        return args

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def shapes(self, p: str) -> dict:
        """``{tensor: (shape, keys)}`` as the vision config sizes them."""
        H, I, O, m2 = self.hidden_size, self.intermediate_size, self.out_hidden_size, self.spatial_merge_size ** 2
        hid, mlp = ("vision_config.hidden_size",), ("vision_config.hidden_size", "vision_config.intermediate_size")
        out = {
            p + "patch_embed.proj.weight": ((H, self.in_channels, self.temporal_patch_size, self.patch_size,
                                             self.patch_size), hid + ("vision_config.patch_size",)),
            p + "patch_embed.proj.bias": ((H,), hid),
            p + "pos_embed.weight": ((self.num_position_embeddings, H),
                                     ("vision_config.num_position_embeddings",) + hid),
            p + "merger.norm.weight": ((H,), hid), p + "merger.norm.bias": ((H,), hid),
            p + "merger.linear_fc1.weight": ((H * m2, H * m2), hid + ("vision_config.spatial_merge_size",)),
            p + "merger.linear_fc1.bias": ((H * m2,), hid + ("vision_config.spatial_merge_size",)),
            p + "merger.linear_fc2.weight": ((O, H * m2), ("vision_config.out_hidden_size",) + hid),
            p + "merger.linear_fc2.bias": ((O,), ("vision_config.out_hidden_size",)),
        }
        for i in range(self.depth):
            b = f"{p}blocks.{i}."
            out.update({
                b + "norm1.weight": ((H,), hid), b + "norm1.bias": ((H,), hid),
                b + "norm2.weight": ((H,), hid), b + "norm2.bias": ((H,), hid),
                b + "attn.qkv.weight": ((3 * H, H), hid), b + "attn.qkv.bias": ((3 * H,), hid),
                b + "attn.proj.weight": ((H, H), hid), b + "attn.proj.bias": ((H,), hid),
                b + "mlp.linear_fc1.weight": ((I, H), mlp), b + "mlp.linear_fc1.bias": ((I,), mlp),
                b + "mlp.linear_fc2.weight": ((H, I), mlp), b + "mlp.linear_fc2.bias": ((H,), mlp),
            })
        return out


def tower_tensors(args: VisionArgs, prefix: str) -> list[str]:
    names = [prefix + n for n in TOWER_TENSORS]
    for i in range(args.depth):
        names += [f"{prefix}blocks.{i}.{n}" for n in BLOCK_TENSORS]
    return names


def merge_block_order(t: int, h: int, w: int, m: int):
    """(row, column) of each patch in the processor's order: frame, merged row, merged column, row and column
    within the ``m × m`` block."""
    for _ in range(t):
        for br in range(h // m):
            for bc in range(w // m):
                for ir in range(m):
                    for ic in range(m):
                        yield br * m + ir, bc * m + ic


def _taps(index: int, size: int, side: int):
    """Bilinear taps with ``align_corners=True`` (transformers' ``_interpolation_axis_taps_weights``): the
    position ``index`` of ``size`` on a ``side``-long table -> ((tap, weight), (tap, weight))."""
    src = index * (side - 1) / max(size - 1, 1)
    lo = int(src // 1)
    return tuple((min(max(lo + o, 0), side - 1), max(0.0, 1.0 - abs(src - lo - o))) for o in (0, 1))


class Block:
    def __init__(self, args: VisionArgs, w, ops):
        self.args, self.ops = args, ops
        self.n1, self.n1b, self.n2, self.n2b = (w(n) for n in ("norm1.weight", "norm1.bias", "norm2.weight",
                                                              "norm2.bias"))
        self.qkv, self.qkv_b = w("attn.qkv.weight"), w("attn.qkv.bias")
        self.proj, self.proj_b = w("attn.proj.weight"), w("attn.proj.bias")
        self.fc1, self.fc1_b = w("mlp.linear_fc1.weight"), w("mlp.linear_fc1.bias")
        self.fc2, self.fc2_b = w("mlp.linear_fc2.weight"), w("mlp.linear_fc2.bias")
        self.act = getattr(ops, ACTIVATIONS[args.hidden_act])

    def __call__(self, x, rope, frames: int):
        a, ops = self.args, self.ops
        N, H, D = x.shape[0], a.num_heads, a.head_dim
        h = ops.layer_norm(x, self.n1, self.n1b, LN_EPS)
        qkv = (ops.linear(h, self.qkv) + self.qkv_b).reshape(N, 3, H, D)
        cos, sin = rope
        q, k, v = ops.apply_rope(qkv[:, 0], cos, sin), ops.apply_rope(qkv[:, 1], cos, sin), qkv[:, 2]
        n = N // frames  # attention within each frame (an image is one)
        parts = [ops.bidirectional_attention(q[f * n:(f + 1) * n], k[f * n:(f + 1) * n], v[f * n:(f + 1) * n],
                                             D ** -0.5) for f in range(frames)]
        o = parts[0] if frames == 1 else ops.concat(parts)
        x = x + (ops.linear(o.reshape(N, H * D), self.proj) + self.proj_b)
        h = ops.layer_norm(x, self.n2, self.n2b, LN_EPS)
        return x + (ops.linear(self.act(ops.linear(h, self.fc1) + self.fc1_b), self.fc2) + self.fc2_b)


class VisionTower:
    """The tower on one backend; ``encode(image) -> (num_tokens, out_hidden_size)`` on that backend."""

    def __init__(self, args: VisionArgs, weights: dict, backend, prefix: str):
        self.args, self.backend, self.ops = args, backend, backend.ops

        def w(name):
            return weights[prefix + name]

        for name, (shape, keys) in args.shapes(prefix).items():  # a tower the vision config does not describe
            if tuple(weights[name].shape) != shape:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(weights[name].shape)}, but the config "
                                      f"implies {shape} from {', '.join(keys)}: the config does not match the weights")
        backend.use()
        kernel = w("patch_embed.proj.weight")  # (H, C, T, P, P): the Conv3d over one patch is a linear
        self.patch = Weight(kernel.reshape(args.hidden_size, args.patch_dim), "f32",
                            (args.hidden_size, args.patch_dim))
        self.patch_b = w("patch_embed.proj.bias")
        self.pos = w("pos_embed.weight")
        self.side = int(round(args.num_position_embeddings ** 0.5))
        self.blocks = [Block(args, lambda n, i=i: w(f"blocks.{i}.{n}"), self.ops) for i in range(args.depth)]
        self.m_norm, self.m_norm_b = w("merger.norm.weight"), w("merger.norm.bias")
        self.m_fc1, self.m_fc1_b = w("merger.linear_fc1.weight"), w("merger.linear_fc1.bias")
        self.m_fc2, self.m_fc2_b = w("merger.linear_fc2.weight"), w("merger.linear_fc2.bias")
        half = args.head_dim // 2  # rotary: half the head's dims, a quarter each for row and column
        inv = [1.0 / args.rope_theta ** (i / half) for i in range(0, half, 2)]
        self.inv_freq, self.section = inv + inv, [half // 2, half // 2, 0]

    def check(self, image) -> tuple[int, int, int]:
        """The image's grid, refused (ValueError) where it does not fit this tower."""
        a = self.args
        grid = tuple(int(g) for g in image.grid)
        if len(grid) != 3 or min(grid) < 1:
            raise ValueError(f"a Qwen image's grid is (t, h, w) patches; it is {image.grid!r}")
        t, h, w = grid
        m = a.spatial_merge_size
        if h % m or w % m:
            raise ValueError(f"the image's grid {grid} is not a multiple of the merge size {m}")
        shape = tuple(image.pixels.shape)
        if shape != (t * h * w, a.patch_dim):
            raise ValueError(f"the image's pixels have shape {shape}; its grid {grid} needs ({t * h * w}, "
                             f"{a.patch_dim}) (patches of {a.in_channels}x{a.temporal_patch_size}x{a.patch_size}"
                             f"x{a.patch_size} values)")
        if image.num_tokens != t * h * w // (m * m):
            raise ValueError(f"the image says it becomes {image.num_tokens} tokens; its grid {grid} merges into "
                             f"{t * h * w // (m * m)}")
        return grid

    def encode(self, image):
        a, ops, b = self.args, self.ops, self.backend
        t, h, w = self.check(image)
        b.use()
        x = ops.linear(b.tensor(image.pixels), self.patch) + self.patch_b  # (N, hidden)
        cells = list(merge_block_order(t, h, w, a.spatial_merge_size))
        x = x + self.position_embeddings(cells, h, w)
        rows = [r for r, _ in cells]
        cols = [c for _, c in cells]
        rope = ops.rope_tables([rows, cols, [0] * len(cells)], self.inv_freq, self.section, False)
        for block in self.blocks:
            x = block(x, rope, t)
        x = ops.layer_norm(x, self.m_norm, self.m_norm_b, LN_EPS)
        x = x.reshape(x.shape[0] // a.spatial_merge_size ** 2, a.hidden_size * a.spatial_merge_size ** 2)
        return ops.linear(ops.gelu(ops.linear(x, self.m_fc1) + self.m_fc1_b), self.m_fc2) + self.m_fc2_b

    def position_embeddings(self, cells, h: int, w: int):
        """The learned table resampled to the (h, w) grid: per patch the weighted sum of its 4 bilinear taps."""
        side, ops, b = self.side, self.ops, self.backend
        taps = [[], [], [], []]
        weights = [[], [], [], []]
        for r, c in cells:
            rt, ct = _taps(r, h, side), _taps(c, w, side)
            for j, ((ri, rw), (ci, cw)) in enumerate((x, y) for x in rt for y in ct):
                taps[j].append(ri * side + ci)
                weights[j].append([rw * cw])
        out = None
        for j in range(4):
            e = ops.embedding(taps[j], self.pos) * b.tensor(weights[j])
            out = e if out is None else out + e
        return out
