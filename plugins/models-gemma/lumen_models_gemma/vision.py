"""Gemma's vision towers (issue 17), on the ``("vision", None)`` component's backend, over the op contract.

- Gemma 4 (``Gemma4Tower``): patches (``ImageInput.pixels`` (N, 3·P·P), rows as transformers' image processor
  flattens them, padding rows allowed) and their (x, y) grid positions (``extra["positions"]`` (N, 2), -1 for
  padding, as ``image_position_ids``): a linear patch embedding of ``2 (p - 0.5)`` plus a learned x and a learned y
  embedding; blocks with Gemma 4's four RMSNorms, q/k norms with weights, a weightless v norm, a 2-D RoPE (the first
  half of each head rotates with the x position, the second half with y, each half in rotate-half pairs), attention
  over every patch of the image (scale 1), a GeGLU MLP; then each k×k patch square averaged (k =
  ``pooling_kernel_size``), scaled by sqrt(hidden), optionally standardized, and the multimodal embedder (RMSNorm
  without weight, a projection into the text width).
- Gemma 3 (``SiglipTower``): SigLIP over a square image (``ImageInput.pixels`` (3, S, S), normalized, as
  transformers' ``pixel_values``): the patch convolution as a linear on flattened patches, learned positions,
  pre-LayerNorm blocks with biases, tanh-GELU MLP, a final LayerNorm; then the multi-modal projector: a k×k average
  pool down to ``mm_tokens_per_image``, Gemma's (1 + w) RMSNorm and the projection into the text width.

Padding patches are dropped before the tower: their keys are masked out and their outputs zeroed in transformers,
so the valid patches' results do not depend on them. Host-side work is limited to cutting the ``ImageInput``'s numpy
arrays into rows; every computation runs through ``ops``.
"""

from __future__ import annotations

from dataclasses import replace

from lumen_core.architecture import read_int
from lumen_core.errors import InputError, PlanError


def vision_key(name: str) -> str | None:
    """A vision tensor's name without where the checkpoint nests it (``model.``, SigLIP's ``vision_model.``): the
    key the towers look weights up by; None for a tensor that is not the vision tower's, projector's or embedder's."""
    rest = name.removeprefix("model.")
    for start in ("vision_tower.", "multi_modal_projector.", "embed_vision."):
        if rest.startswith(start):
            return rest.replace("vision_tower.vision_model.", "vision_tower.", 1)
    return None


def _prefix(names, candidates, probe: str) -> str:
    """Where a checkpoint keeps a module: the first candidate prefix with ``probe`` under it (else the first)."""
    return next((c for c in candidates if c + probe in names), candidates[0])


def _vint(vc: dict, key: str, default: int) -> int:
    return read_int(vc, key, 1, default, label="vision_config." + key)


def gemma4_tensors(config: dict, names) -> dict:
    """``{tensor: (shape, config keys)}`` of Gemma 4's vision tower and embedder, as ``vision_config`` sizes them:
    the tensors the vision component needs (a missing one is refused before loading, a wrong shape names the
    keys)."""
    vc, text = config.get("vision_config") or {}, config.get("text_config") or {}
    H, I = _vint(vc, "hidden_size", 768), _vint(vc, "intermediate_size", 3072)
    heads = _vint(vc, "num_attention_heads", 12)
    kv, hd = _vint(vc, "num_key_value_heads", heads), _vint(vc, "head_dim", H // heads)
    P, S = _vint(vc, "patch_size", 16), _vint(vc, "position_embedding_size", 10 * 1024)
    k = "vision_config."
    hid, mlp, att = (k + "hidden_size",), (k + "hidden_size", k + "intermediate_size"), \
        (k + "num_attention_heads", k + "num_key_value_heads", k + "head_dim", k + "hidden_size")
    p = _prefix(names, ("model.vision_tower.", "vision_tower."), "patch_embedder.input_proj.weight")
    e = _prefix(names, ("model.embed_vision.", "embed_vision."), "embedding_projection.weight")
    out = {p + "patch_embedder.input_proj.weight": ((H, 3 * P * P), hid + (k + "patch_size",)),
           p + "patch_embedder.position_embedding_table": ((2, S, H), (k + "position_embedding_size",) + hid),
           e + "embedding_projection.weight": ((text.get("hidden_size"), H), ("hidden_size",) + hid)}
    if vc.get("standardize", False):
        out.update({p + "std_bias": ((H,), hid), p + "std_scale": ((H,), hid)})
    linears = {"self_attn.q_proj": (heads * hd, H), "self_attn.k_proj": (kv * hd, H), "self_attn.v_proj": (kv * hd, H),
               "self_attn.o_proj": (H, heads * hd), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H),
               "mlp.down_proj": (H, I)}
    for i in range(_vint(vc, "num_hidden_layers", 16)):
        L = f"{p}encoder.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            out[f"{L}{n}.weight"] = ((H,), hid)
        out[L + "self_attn.q_norm.weight"] = out[L + "self_attn.k_norm.weight"] = ((hd,), (k + "head_dim",))
        for n, shape in linears.items():
            out[f"{L}{n}.linear.weight"] = (shape, att if n.startswith("self_attn") else mlp)
            if vc.get("use_clipped_linears", False):
                for b in ("input_min", "input_max", "output_min", "output_max"):
                    out[f"{L}{n}.{b}"] = ((), (k + "use_clipped_linears",))
    return out


def siglip_tensors(config: dict, names) -> dict:
    """``{tensor: (shape, config keys)}`` of Gemma 3's SigLIP tower (without its unused pooling head) and its
    multi-modal projector."""
    vc, text = config.get("vision_config") or {}, config.get("text_config") or {}
    H, I = _vint(vc, "hidden_size", 768), _vint(vc, "intermediate_size", 3072)
    C, P, size = _vint(vc, "num_channels", 3), _vint(vc, "patch_size", 16), _vint(vc, "image_size", 224)
    k = "vision_config."
    hid, mlp = (k + "hidden_size",), (k + "hidden_size", k + "intermediate_size")
    p = _prefix(names, ("vision_tower.vision_model.", "model.vision_tower.vision_model.", "vision_tower.",
                        "model.vision_tower."), "embeddings.patch_embedding.weight")
    m = _prefix(names, ("multi_modal_projector.", "model.multi_modal_projector."), "mm_soft_emb_norm.weight")
    out = {p + "embeddings.patch_embedding.weight": ((H, C, P, P), hid + (k + "num_channels", k + "patch_size")),
           p + "embeddings.patch_embedding.bias": ((H,), hid),
           p + "embeddings.position_embedding.weight": (((size // P) ** 2, H),
                                                        (k + "image_size", k + "patch_size") + hid),
           p + "post_layernorm.weight": ((H,), hid), p + "post_layernorm.bias": ((H,), hid),
           m + "mm_input_projection_weight": ((H, text.get("hidden_size")), hid + ("hidden_size",)),
           m + "mm_soft_emb_norm.weight": ((H,), hid)}
    shapes = {"layer_norm1": (H,), "layer_norm2": (H,), "self_attn.q_proj": (H, H), "self_attn.k_proj": (H, H),
              "self_attn.v_proj": (H, H), "self_attn.out_proj": (H, H), "mlp.fc1": (I, H), "mlp.fc2": (H, I)}
    for i in range(_vint(vc, "num_hidden_layers", 12)):
        L = f"{p}encoder.layers.{i}."
        for n, shape in shapes.items():
            keys = mlp if n.startswith("mlp") else hid
            out[f"{L}{n}.weight"] = (shape, keys)
            out[f"{L}{n}.bias"] = ((shape[0],), keys)
    return out


def _weights(weights: dict) -> dict:
    return {vision_key(n): w for n, w in weights.items() if vision_key(n) is not None}


def _reshaped(w, rows: int, cols: int):
    """A matrix Weight viewed as (rows, cols) (a conv kernel as a linear map on flattened patches)."""
    if w.scale is not None or w.format not in ("f32", "bf16", "f16"):
        raise PlanError(f"a vision kernel in format {w.format!r} cannot be reshaped into a matrix")
    return replace(w, data=w.data.reshape(rows, cols), shape=(rows, cols))


def _pool(ops, x, rows: int, cols: int, k: int):
    """x (rows·cols, D) in row-major grid order -> (rows/k · cols/k, D): the mean of each k×k square, in row-major
    order of the squares (transformers' AvgPool2d, and Gemma 4's pooling by positions)."""
    D = x.shape[-1]
    grid = x.reshape(rows // k, k, cols // k, k, D)
    total = None
    for a in range(k):
        for b in range(k):
            part = grid[:, a, :, b]
            total = part if total is None else total + part
    return total.reshape((rows // k) * (cols // k), D) * (1.0 / (k * k))


class Gemma4Tower:
    def __init__(self, arch, weights: dict, backend):
        self.backend, self.ops = backend, backend.ops
        vc, w = arch.config["vision_config"], _weights(weights)
        self.hidden = vc.get("hidden_size", 768)
        self.heads = vc.get("num_attention_heads", 12)
        self.kv_heads = vc.get("num_key_value_heads", self.heads)
        self.head_dim = vc.get("head_dim") or self.hidden // self.heads
        self.patch, self.k = vc.get("patch_size", 16), vc.get("pooling_kernel_size", 3)
        self.eps = vc.get("rms_norm_eps", 1e-6)
        act = vc.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise PlanError(f"vision_config.hidden_activation {act!r} is not supported (Gemma 4 uses tanh GELU)")
        rope = vc.get("rope_parameters") or {}
        # released configs say "default": for this tower that means its axial 2-D RoPE (transformers reads it so)
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise PlanError(f"vision_config.rope_parameters.rope_type {rope.get('rope_type')!r}: only 'axial' "
                            "(or 'default', which is axial for Gemma 4's vision tower)")
        theta, spatial = rope.get("rope_theta", 100.0), self.head_dim // 2
        self.inv_freq = [1.0 / theta ** (i / spatial) for i in range(0, spatial, 2)]
        self.clipped = bool(vc.get("use_clipped_linears", False))
        p = "vision_tower."
        self.input_proj = w[p + "patch_embedder.input_proj.weight"]
        self.pos_table = w[p + "patch_embedder.position_embedding_table"]  # (2, S, hidden): x rows, y rows
        self.std = (w[p + "std_bias"], w[p + "std_scale"]) if vc.get("standardize", False) else None
        self.layers = []
        for i in range(vc.get("num_hidden_layers", 16)):
            L = f"{p}encoder.layers.{i}."
            self.layers.append({
                "norms": [w[f"{L}{n}.weight"] for n in ("input_layernorm", "post_attention_layernorm",
                                                         "pre_feedforward_layernorm", "post_feedforward_layernorm")],
                "q_norm": w[L + "self_attn.q_norm.weight"], "k_norm": w[L + "self_attn.k_norm.weight"],
                **{n: self._linear(w, f"{L}self_attn.{n}") for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                **{n: self._linear(w, f"{L}mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj")},
            })
        self.projection = w["embed_vision.embedding_projection.weight"]

    def _linear(self, w: dict, prefix: str):
        """(Weight, input range, output range) of a clippable linear; the ranges are None when not clipped."""
        if not self.clipped:
            return w[prefix + ".linear.weight"], None, None
        host = self.backend.to_host

        def bounds(a, b):
            lo, hi = float(host(w[f"{prefix}.{a}"]).reshape(-1)[0]), float(host(w[f"{prefix}.{b}"]).reshape(-1)[0])
            return None if lo == float("-inf") and hi == float("inf") else (lo, hi)

        return w[prefix + ".linear.weight"], bounds("input_min", "input_max"), bounds("output_min", "output_max")

    def _apply(self, x, lin):
        weight, into, out = lin
        ops = self.ops
        if into is not None:
            x = ops.clamp(x, *into)
        y = ops.linear(x, weight)
        return y if out is None else ops.clamp(y, *out)

    def _rope_tables(self, positions, heads: int):
        """cos, sin for the 2-D RoPE of (T, heads, D): dims [:D/2] rotate with the x position, [D/2:] with y, each
        half in rotate-half pairs. Each head's two halves become rows of their own with their own position, so one
        ``rope_tables`` / ``apply_rope`` does both axes (both use the same frequencies)."""
        pos = [p for xy in positions for _ in range(heads) for p in xy]  # (t, head, half) order
        return self.ops.rope_tables(pos, self.inv_freq)

    def _rope(self, x, tables):
        T, heads, D = x.shape
        return self.ops.apply_rope(x.reshape(T * heads * 2, 1, D // 2), *tables).reshape(T, heads, D)

    def _layer(self, x, layer, ropes):
        ops, eps, T = self.ops, self.eps, x.shape[0]
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        n_in, n_post_attn, n_pre_ff, n_post_ff = layer["norms"]
        h = ops.rms_norm(x, n_in, eps)
        q = self._rope(ops.rms_norm(self._apply(h, layer["q_proj"]).reshape(T, H, D), layer["q_norm"], eps),
                       ropes[0])
        k = self._rope(ops.rms_norm(self._apply(h, layer["k_proj"]).reshape(T, Hkv, D), layer["k_norm"], eps),
                       ropes[1])
        v = ops.rms_norm(self._apply(h, layer["v_proj"]).reshape(T, Hkv, D), None, eps)
        o = self._apply(ops.bidirectional_attention(q, k, v, 1.0).reshape(T, H * D), layer["o_proj"])
        x = x + ops.rms_norm(o, n_post_attn, eps)
        h = ops.rms_norm(x, n_pre_ff, eps)
        h = self._apply(ops.gelu_tanh_mul(self._apply(h, layer["gate_proj"]), self._apply(h, layer["up_proj"])),
                        layer["down_proj"])
        return x + ops.rms_norm(h, n_post_ff, eps)

    def encode(self, image):
        """One ``ImageInput`` -> (num_tokens, text hidden) embeddings on the vision backend."""
        ops, k = self.ops, self.k
        pixels, positions = _gemma4_patches(image)
        cols, rows = max(x for x, _ in positions) + 1, max(y for _, y in positions) + 1
        if [tuple(p) for p in positions] != [(x, y) for y in range(rows) for x in range(cols)]:
            raise InputError("a Gemma 4 image's patch positions must be its grid in row-major order (as the image "
                             "processor makes them)")
        if rows % k or cols % k:
            raise InputError(f"a Gemma 4 image of {rows}x{cols} patches does not pool by {k}x{k} squares")
        self.backend.use()
        x = self.backend.tensor(pixels)
        x = ops.linear((x - 0.5) * 2.0, self.input_proj)
        xs, ys = [p[0] for p in positions], [p[1] for p in positions]
        x = x + (ops.gather(self.pos_table[0], xs) + ops.gather(self.pos_table[1], ys))
        q_tables = self._rope_tables(positions, self.heads)
        ropes = (q_tables, q_tables if self.kv_heads == self.heads else self._rope_tables(positions, self.kv_heads))
        for layer in self.layers:
            x = self._layer(x, layer, ropes)
        x = _pool(ops, x, rows, cols, k) * (self.hidden ** 0.5)
        if self.std is not None:
            x = (x - self.std[0]) * self.std[1]
        return ops.linear(ops.rms_norm(x, None, self.eps), self.projection)


def _gemma4_patches(image):
    """The valid patch rows (host f32 (n, 3·P·P)) and their [x, y] positions of a Gemma 4 ``ImageInput``."""
    pixels = image.pixels
    pixels = pixels.reshape(pixels.shape[-2], pixels.shape[-1]) if pixels.ndim == 3 else pixels
    positions = next((image.extra[k] for k in ("positions", "image_position_ids", "pixel_position_ids")
                      if k in image.extra), None)
    if positions is None:
        raise InputError("a Gemma 4 ImageInput needs the patch positions (extra['positions'], (N, 2) x, y)")
    positions = [[int(a), int(b)] for a, b in positions.reshape(-1, 2).tolist()]
    valid = [p for p in positions if p[0] >= 0 and p[1] >= 0]
    if positions[:len(valid)] != valid or len(positions) != pixels.shape[0]:
        raise InputError("a Gemma 4 ImageInput's padding patches (position -1) must follow its patches, one "
                         "position per row of pixels")
    return pixels[:len(valid)], valid


class SiglipTower:
    """Gemma 3's SigLIP vision model and multi-modal projector."""

    def __init__(self, arch, weights: dict, backend):
        self.backend, self.ops = backend, backend.ops
        vc, w = arch.config["vision_config"], _weights(weights)
        self.hidden = vc.get("hidden_size", 768)
        self.heads = vc.get("num_attention_heads", 12)
        self.patch, self.size = vc.get("patch_size", 16), vc.get("image_size", 224)
        self.channels = vc.get("num_channels", 3)
        self.eps = vc.get("layer_norm_eps", 1e-6)
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
            raise PlanError(f"vision_config.hidden_act {act!r} is not supported (SigLIP: gelu_pytorch_tanh, gelu)")
        self.act = backend.ops.gelu if act == "gelu" else backend.ops.gelu_tanh
        self.side = self.size // self.patch  # patches per side
        per_side = int(round(arch.config.get("mm_tokens_per_image", 256) ** 0.5))
        if per_side * per_side != arch.config.get("mm_tokens_per_image", 256) or self.side % per_side:
            raise PlanError(f"mm_tokens_per_image {arch.config.get('mm_tokens_per_image')} does not pool a "
                            f"{self.side}x{self.side} patch grid into squares")
        self.tokens_per_side, self.k = per_side, self.side // per_side
        p = "vision_tower."
        conv = w[p + "embeddings.patch_embedding.weight"]
        self.patch_proj = _reshaped(conv, conv.shape[0], self.channels * self.patch * self.patch)
        self.patch_bias = w[p + "embeddings.patch_embedding.bias"]
        self.positions = w[p + "embeddings.position_embedding.weight"]  # (num_patches, hidden)
        self.layers = []
        for i in range(vc.get("num_hidden_layers", 12)):
            L = f"{p}encoder.layers.{i}."
            self.layers.append({n: (w[f"{L}{n}.weight"], w[f"{L}{n}.bias"]) for n in (
                "layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                "self_attn.out_proj", "mlp.fc1", "mlp.fc2")})
        self.post = (w[p + "post_layernorm.weight"], w[p + "post_layernorm.bias"])
        self.soft_norm = w["multi_modal_projector.mm_soft_emb_norm.weight"]
        proj = w["multi_modal_projector.mm_input_projection_weight"]  # (vision hidden, text hidden): x @ W
        host = backend.to_host(proj.data)
        # a private copy, transposed: in host RAM where the backend computes from it (cpu, cuda), else where the
        # checkpoint's placement put it (wgpu keeps weights in vram only)
        store = "ram" if "ram" in type(backend).stores else proj.store
        self.projection = backend.weight(host.T.copy(), proj.format, store)

    def _linear(self, x, wb):
        return self.ops.linear(x, wb[0]) + wb[1]

    def encode(self, image):
        ops, eps, T, H = self.ops, self.eps, self.side * self.side, self.heads
        pixels = image.pixels
        C, S, P, n = self.channels, self.size, self.patch, self.side
        if pixels.size != C * S * S:
            raise InputError(f"a Gemma 3 image must be {C}x{S}x{S} pixels (the tower's image_size); this one has "
                             f"shape {tuple(pixels.shape)}")
        # the patch convolution as a linear map: rows in the conv output's (row, column) order, columns in the
        # kernel's (channel, y, x) order
        patches = pixels.reshape(C, n, P, n, P).transpose(1, 3, 0, 2, 4).reshape(T, C * P * P)
        self.backend.use()
        x = self.ops.linear(self.backend.tensor(patches), self.patch_proj) + self.patch_bias
        x = x + self.positions
        D = self.hidden // H
        for layer in self.layers:
            h = ops.layer_norm(x, *layer["layer_norm1"], eps)
            q, k, v = (self._linear(h, layer[f"self_attn.{n}_proj"]).reshape(T, H, D) for n in "qkv")
            o = ops.bidirectional_attention(q, k, v, D ** -0.5).reshape(T, H * D)
            x = x + self._linear(o, layer["self_attn.out_proj"])
            h = ops.layer_norm(x, *layer["layer_norm2"], eps)
            x = x + self._linear(self.act(self._linear(h, layer["mlp.fc1"])), layer["mlp.fc2"])
        x = ops.layer_norm(x, *self.post, eps)
        x = _pool(ops, x, n, n, self.k)
        return ops.linear(ops.rms_norm(x, self.soft_norm, eps, 1.0), self.projection)
