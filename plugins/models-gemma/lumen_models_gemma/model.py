"""The Gemma 3 / Gemma 4 forward pass, component by component. Each component computes on its own backend;
the hidden state of the current tokens (and Gemma 4's per-layer inputs) are all that move between them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lumen_core.architecture import Model, Segmented
from lumen_core.errors import InputError, PlanError

from .common import NORMS, round_to_format


@dataclass
class Cache:
    capacity: int  # tokens
    layers: list = field(default_factory=list)  # per layer: its KV cache (a ring on sliding layers), or the
    pos: int = 0  # tokens already in the cache         cache of the layer it shares (KV-shared layers)


def _w(weights: dict, prefix: str):
    """Local view: ``w("self_attn.q_proj.weight")`` looks up ``prefix + name``."""
    return lambda name: weights[prefix + name]


class Attention:
    def __init__(self, arch, spec, w, ops):
        self.arch, self.spec, self.ops = arch, spec, ops
        self.q, self.o, self.q_norm = (w(f"self_attn.{n}.weight") for n in ("q_proj", "o_proj", "q_norm"))
        if spec.shared_from is None:
            self.k, self.k_norm = w("self_attn.k_proj.weight"), w("self_attn.k_norm.weight")
            self.v = None if spec.k_eq_v else w("self_attn.v_proj.weight")

    def new_state(self, ctx: int, kv):
        s, ops = self.spec, self.ops
        if s.window is not None and s.window < ctx:  # only the window is ever read again: keep a ring
            return ops.sliding_kv_cache(s.window, s.kv_heads, s.head_dim, kv.type_k, kv.type_v)
        return ops.kv_cache(ctx, s.kv_heads, s.head_dim, kv.type_k, kv.type_v)

    def __call__(self, h, state, start: int, rope, blocks=None):
        arch, s, ops, T = self.arch, self.spec, self.ops, h.shape[0]
        image = {"blocks": blocks} if blocks else {}  # a text-only call keeps the text-only signature
        eps, off, H, D = arch.args.rms_norm_eps, arch.norm_offset, arch.args.num_attention_heads, s.head_dim
        cos, sin = rope
        if s.shared_from is not None:
            q = ops.linear(h, self.q)
        else:
            q, k, *v = ops.linear_group(h, [self.q, self.k] + ([] if self.v is None else [self.v]))
        q = ops.apply_rope(ops.rms_norm(q.reshape(T, H, D), self.q_norm, eps, off), cos, sin)
        batched = isinstance(state, Segmented)  # several sequences: each attends over its own cache
        if s.shared_from is not None:
            if batched:
                o = state.each(ops, lambda q, st, s0: ops.attention_shared(q, st, s0, arch.attn_scale, s.window), q)
            else:
                o = ops.attention_shared(q, state, start, arch.attn_scale, s.window, **image)
        else:
            k = k.reshape(T, s.kv_heads, D)
            v = k if self.v is None else v[0].reshape(T, s.kv_heads, D)
            k = ops.apply_rope(ops.rms_norm(k, self.k_norm, eps, off), cos, sin)
            if arch.v_norm:
                v = ops.rms_norm(v, None, eps)
            if batched:
                o = ops.attention_segments(q, k, v, state.states, state.starts, state.spans, arch.attn_scale,
                                           s.window)
            else:
                o = ops.attention(q, k, v, state, start, arch.attn_scale, s.window, **image)
        return ops.linear(o.reshape(T, H * D), self.o)


class MLP:
    def __init__(self, w, ops):
        self.ops = ops
        self.gate, self.up, self.down = (w(f"mlp.{n}_proj.weight") for n in ("gate", "up", "down"))

    def __call__(self, h):
        ops = self.ops
        return ops.linear(ops.gelu_tanh_mul(*ops.linear_group(h, [self.gate, self.up])), self.down)


class MoE:
    """Gemma 4's routed experts beside the dense MLP. Router on the layer's backend; the packed experts on the
    experts component's backend. The router reads the residual stream before the feed-forward norm."""

    def __init__(self, arch, w, backend, ew, experts_backend, layer_prefix: str):
        self.a, self.backend, self.ops = arch.args, backend, backend.ops
        self.ebackend = experts_backend
        self.proj, self.scale = w("router.proj.weight"), w("router.scale")
        self.expert_scale = w("router.per_expert_scale")
        self.pre2, self.post1, self.post2 = (w(f"{n}.weight") for n in (
            "pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"))
        if arch.split_experts:  # GGUF: a (2I, H) and an (H, I) matrix per expert, in the file's format
            p = layer_prefix + "experts."
            E = self.a.num_experts
            self.pairs = [_halves(ew[f"{p}{e}.gate_up_proj.weight"]) for e in range(E)]
            self.downs = [ew[f"{p}{e}.down_proj.weight"] for e in range(E)]
        else:
            self.pairs = None
            self.gate_up, self.down = ew[layer_prefix + "experts.gate_up_proj"], ew[layer_prefix + "experts.down_proj"]

    def __call__(self, x, dense):
        """x (T, H) the residual stream; dense (T, H) the dense MLP's output -> (T, H)."""
        a, ops, eps = self.a, self.ops, self.a.rms_norm_eps
        r = ops.rms_norm(x, None, eps) * self.scale * a.hidden_size ** -0.5
        weights, ids = ops.moe_route(ops.linear(r, self.proj), a.top_k_experts, True)  # (T, k)
        weights = weights * ops.gather(self.expert_scale, ids)
        h = ops.rms_norm(x, self.pre2, eps)
        routed = self.backend.call(self.ebackend, self._routed, h, ids, weights)  # on the experts' backend
        return ops.rms_norm(dense, self.post1, eps) + ops.rms_norm(routed, self.post2, eps)

    def _routed(self, h, ids, weights):
        if self.pairs is not None:
            return self.ebackend.ops.moe_experts(h, ids, weights, self.pairs, self.downs, act="gelu_tanh")
        return self.ebackend.ops.moe_experts_packed(h, ids, weights, self.gate_up, self.down)


def _halves(w):
    """An expert's (2I, H) gate+up matrix as its gate rows and its up rows: row views of the same data (a
    block-quantized matrix is stored (rows, bytes per row), so its first I rows are a byte range too)."""
    if w.scale is not None or len(w.shape) != 2 or w.shape[0] % 2:
        raise PlanError(f"a per-expert gate_up matrix of shape {w.shape} ({w.format}) cannot be split into gate and up")
    rows = w.shape[0] // 2
    return tuple(replace(w, data=w.data[a:b], shape=(rows, w.shape[1])) for a, b in ((0, rows), (rows, 2 * rows)))


class DecoderLayer:
    def __init__(self, arch, i: int, weights, backends):
        p = f"{arch.prefix}layers.{i}."
        self.backend = backends[("layer", i)]
        self.backend.use()  # what the layer precomputes goes to its own device
        ops, w = self.backend.ops, _w(weights[("layer", i)], p)
        self.arch, self.ops, self.spec = arch, ops, arch.specs[i]
        self.attn = Attention(arch, self.spec, w, ops)
        self.mlp = MLP(w, ops)
        self.norms = [w(f"{n}.weight") for n in NORMS]  # input, post-attention, pre-ff, post-ff
        self.moe = MoE(arch, w, self.backend, weights[("experts", i)], backends[("experts", i)], p) \
            if ("experts", i) in weights else None
        self.scalar = w("layer_scalar") if arch.layer_scalar else None
        self.bidirectional = arch.image_bidirectional(self.spec)  # image tokens see their whole image
        if getattr(arch, "per_layer_dim", 0):
            self.pl_gate, self.pl_proj = w("per_layer_input_gate.weight"), w("per_layer_projection.weight")
            self.pl_norm = w("post_per_layer_input_norm.weight")
        # Gemma 3's layer (own K/V, no value norm, a dense MLP, no scalar or per-layer input) is the optional op
        # sandwich_layer: one call, which the CPU runs compiled for a decode step; the same ops otherwise
        a = self.attn
        self.sandwich = None if (self.spec.shared_from is not None or a.v is None or arch.v_norm or self.moe or
                                 self.scalar is not None or getattr(arch, "per_layer_dim", 0)) else (
            (a.q, a.k, a.v, a.q_norm, a.k_norm, a.o), (self.mlp.gate, self.mlp.up, self.mlp.down),
            (arch.args.num_attention_heads, self.spec.kv_heads, self.spec.head_dim))

    def __call__(self, x, state, start: int, rope, per_layer=None, blocks=None):
        ops, eps, off = self.ops, self.arch.args.rms_norm_eps, self.arch.norm_offset
        if self.sandwich is not None and not (blocks and self.bidirectional) and not isinstance(state, Segmented):
            attn, mlp, dims = self.sandwich
            return ops.sandwich_layer(x, self.norms, attn, mlp, state, start, rope, dims, self.arch.attn_scale,
                                      self.spec.window, eps, off)
        n_in, n_post_attn, n_pre_ff, n_post_ff = self.norms
        h = self.attn(ops.rms_norm(x, n_in, eps, off), state, start, rope, blocks if self.bidirectional else None)
        # x + the normed attention output, and its pre-feed-forward norm: one op (one kernel on cuda)
        x, h = ops.add_rms_norm(x, ops.rms_norm(h, n_post_attn, eps, off), n_pre_ff, eps, off)
        h = self.mlp(h)
        if self.moe is not None:
            h = self.moe(x, h)
        x = x + ops.rms_norm(h, n_post_ff, eps, off)
        if per_layer is not None:  # (T, P): gate the layer's own input vector, project it back to H
            g = ops.gelu_tanh_mul(ops.linear(x, self.pl_gate), per_layer)
            x = x + ops.rms_norm(ops.linear(g, self.pl_proj), self.pl_norm, eps)
        return x if self.scalar is None else x * self.scalar


class GemmaModel(Model):
    def __init__(self, arch, weights, backends, kv):
        self.arch, self.args, self.kv = arch, arch.args, kv
        self.vocab_size = arch.args.vocab_size
        p, a = arch.prefix, arch.args
        self.in_backend = backends[("input-layer", None)]
        inputs = weights[("input-layer", None)]
        self.embed = inputs[p + "embed_tokens.weight"]
        scale_format = getattr(arch, "embed_scale_format", None)  # GGUF: f32, as llama.cpp
        self.embed_scale = round_to_format(a.hidden_size ** 0.5, scale_format or self.embed.format)
        self.id_map = arch.embed_id_map()
        self.per_layer_dim = getattr(arch, "per_layer_dim", 0)
        if self.per_layer_dim:
            self.pl_embed = inputs[p + "embed_tokens_per_layer.weight"]  # (vocab, L * P)
            self.pl_embed_scale = round_to_format(self.per_layer_dim ** 0.5, scale_format or self.pl_embed.format)
            self.pl_proj = inputs[p + "per_layer_model_projection.weight"]  # (L * P, H)
            self.pl_norm = inputs[p + "per_layer_projection_norm.weight"]
        self.out_backend = backends[("output-layer", None)]
        out = weights[("output-layer", None)]
        self.norm = out[p + "norm.weight"]
        self.head = out[arch.head]  # tied: the embedding table
        self.layers = [DecoderLayer(arch, i, weights, backends) for i in range(arch.num_layers)]
        self.vision_backend = backends.get(("vision", None)) if ("vision", None) in weights else None
        if self.vision_backend is not None:
            self.vision_backend.use()
            self.tower = arch.vision_tower(weights[("vision", None)], self.vision_backend)
        shared = [i for i, s in enumerate(arch.specs) if s.shared_from is not None]
        self.first_shared = shared[0] if shared else None
        for i in shared:  # the cache lives on the producer's device; the reader must compute there too
            j = arch.specs[i].shared_from
            if backends[("layer", i)] is not backends[("layer", j)]:
                raise PlanError(f"layers.{i} reads the KV cache of layers.{j} (KV sharing): place both on one "
                                "device")

    def new_cache(self, context_size: int) -> Cache:
        states = []
        for layer in self.layers:
            s = layer.spec
            layer.backend.use()  # the layer's cache on its own device (several GPUs in one plan)
            states.append(states[s.shared_from] if s.shared_from is not None
                          else layer.attn.new_state(context_size, self.kv))
        return Cache(context_size, states)

    def encode_images(self, images: list) -> list:
        """Each ``ImageInput`` through the vision tower: (num_tokens, hidden) embeddings on the vision backend."""
        if self.vision_backend is None:
            raise InputError("this model was loaded without its vision tower (the config has no vision block)")
        out = []
        for image in images:
            emb = self.tower.encode(image)
            if emb.shape[0] != image.num_tokens:
                raise InputError(f"an image became {emb.shape[0]} embeddings in the vision tower but its ImageInput "
                                 f"says {image.num_tokens} tokens")
            out.append(emb)
        return out

    def image_spans(self, ids, images) -> list[tuple[int, int]]:
        """[(first, end)] of each run of image tokens in ``ids`` (indices into this call), one per image in order;
        InputError where the runs and the images differ."""
        token, spans, i, T = self.arch.image_token_id, [], 0, len(ids)
        while i < T:
            if ids[i] == token:
                j = i
                while j < T and ids[j] == token:
                    j += 1
                spans.append((i, j))
                i = j
            else:
                i += 1
        if len(spans) != len(images):
            raise InputError(f"the prompt holds {len(spans)} run(s) of image tokens but {len(images)} image(s) came "
                             "with it: one run per image (expand the placeholders first)")
        for n, ((a, b), (_, emb)) in enumerate(zip(spans, images, strict=True)):
            if b - a != emb.shape[0]:
                raise InputError(f"image {n + 1}: its run holds {b - a} image tokens but the image has "
                                 f"{emb.shape[0]} embeddings")
        return spans

    def embed_inputs(self, ids, spans=None, images=None):
        """(T, H) scaled embeddings, and Gemma 4's per-layer inputs (T, L, P) or None. ``spans``: where each of
        ``images`` (``(ImageInput, embeddings)``) replaces the embeddings, unscaled (as transformers scatters the
        tower's output over the scaled text embeddings); Gemma 4's per-layer inputs then project the merged rows."""
        ops, a = self.in_backend.ops, self.args
        self.in_backend.use()  # a forward starts on the input layer's device (several GPUs in one plan)
        ids = [self.input_id(t) for t in ids] if self.id_map else ids
        x = ops.embedding(ids, self.embed) * self.embed_scale
        if spans:
            parts, last = [], 0
            for (first, end), (_, emb) in zip(spans, images, strict=True):
                parts += [x[last:first], self.in_backend.take(emb)]
                last = end
            x = ops.concat(parts + [x[last:]])
        if not self.per_layer_dim:
            return x, None
        T, L, P = len(ids), self.arch.num_layers, self.per_layer_dim
        token = (ops.embedding(ids, self.pl_embed) * self.pl_embed_scale).reshape(T, L, P)
        context = (ops.linear(x, self.pl_proj) * a.hidden_size ** -0.5).reshape(T, L, P)
        context = ops.rms_norm(context, self.pl_norm, a.rms_norm_eps)
        return x, (context + token) * 2 ** -0.5

    def input_id(self, token: int) -> int:
        return self.id_map.get(token, token)

    def forward_batch(self, segments):
        """Several sequences in one pass (``Model.forward_batch``): every row goes through the projections, norms
        and MLPs together; attention runs per sequence on its own cache (KV-shared layers too)."""
        ids, spans, positions, caches = [], [], [], []
        for seg, cache in segments:
            spans.append((len(ids), len(ids) + len(seg)))
            ids += list(seg)
            positions += range(cache.pos, cache.pos + len(seg))
            caches.append(cache)
        x, per_layer = self.embed_inputs(ids)
        starts, ropes = [c.pos for c in caches], {}
        for i, layer in enumerate(self.layers):
            b = layer.backend
            x = b.take(x)
            key = (b, layer.spec.type)
            if key not in ropes:
                ropes[key] = b.ops.rope_tables(positions, self.arch.inv_freq[layer.spec.type])
            pl = None if per_layer is None else b.take(per_layer)[:, i]
            x = layer(x, Segmented(spans, [c.layers[i] for c in caches], starts), None, ropes[key], pl)
        for (first, end), cache in zip(spans, caches, strict=True):
            cache.pos += end - first
        ob = self.out_backend
        x = ob.take(x)
        x = x[-1:] if len(spans) == 1 else ob.ops.concat([x[end - 1:end] for _, end in spans])
        logits = ob.ops.linear(ob.ops.rms_norm(x, self.norm, self.args.rms_norm_eps, self.arch.norm_offset), self.head)
        if self.arch.final_softcap:
            logits = ob.ops.softcap(logits, self.arch.final_softcap)
        return ob.to_host(logits)

    def forward(self, ids, cache: Cache, all_logits: bool = False, host: bool = True, images=None):
        start, T = cache.pos, len(ids)
        spans = self.image_spans(ids, images) if images else None
        x, per_layer = self.embed_inputs(ids, spans, images)
        blocks = [(start + first, start + end) for first, end in spans] if spans else None
        positions, first, ropes = list(range(start, start + T)), start, {}
        for i, (layer, state) in enumerate(zip(self.layers, cache.layers, strict=True)):
            if i == self.first_shared and not all_logits and T > 1:
                # KV-shared layers write no cache: only the last token's path to the logits is left to run.
                x, first, positions, ropes = x[T - 1:], start + T - 1, positions[T - 1:], {}
                per_layer = None if per_layer is None else per_layer[T - 1:]
            b = layer.backend
            x = b.take(x)  # first: it makes b's device current, where the rope tables go
            key = (b, layer.spec.type)
            if key not in ropes:
                ropes[key] = b.ops.rope_tables(positions, self.arch.inv_freq[layer.spec.type])
            pl = None if per_layer is None else b.take(per_layer)[:, i]
            x = layer(x, state, first, ropes[key], pl, blocks)
        cache.pos += T
        ob = self.out_backend
        x = ob.take(x if all_logits else x[x.shape[0] - 1:])
        logits = ob.ops.linear(ob.ops.rms_norm(x, self.norm, self.args.rms_norm_eps, self.arch.norm_offset), self.head)
        if self.arch.final_softcap:
            logits = ob.ops.softcap(logits, self.arch.final_softcap)
        return ob.to_host(logits) if host else logits
