"""The Qwen 3.5 forward pass, component by component. Each component computes on its own backend; the
hidden state of the current tokens is the only thing that moves between them."""

from __future__ import annotations

from dataclasses import dataclass, field

from lumen_core import speculative
from lumen_core.architecture import Model, Segmented
from lumen_core.errors import InputError


@dataclass
class Cache:
    capacity: int  # tokens
    layers: list = field(default_factory=list)  # per layer: KV cache, or (conv state, delta state)
    pos: int = 0  # tokens already in the cache
    # rope position - cache position of the next token: 0 for text; after an image, text continues from the image's
    # largest M-RoPE position + 1 (transformers' rope_deltas), so decode steps rotate at pos + rope_offset
    rope_offset: int = 0


def _w(weights: dict, prefix: str):
    """Local view: ``w("self_attn.q_proj.weight")`` looks up ``prefix + name``."""
    return lambda name: weights[prefix + name]


class FullAttention:
    def __init__(self, a, w, ops):
        self.a, self.ops = a, ops
        self.q, self.k, self.v, self.o = (w(f"self_attn.{n}_proj.weight") for n in "qkvo")
        self.q_norm, self.k_norm = w("self_attn.q_norm.weight"), w("self_attn.k_norm.weight")

    def new_state(self, ctx: int, kv):
        return self.ops.kv_cache(ctx, self.a.num_key_value_heads, self.a.head_dim, kv.type_k, kv.type_v)

    def __call__(self, h, state, start: int, rope):
        a, ops, T = self.a, self.ops, h.shape[0]
        D, H, Hkv = a.head_dim, a.num_attention_heads, a.num_key_value_heads
        qg, k, v = ops.linear_group(h, [self.q, self.k, self.v])
        qg = qg.reshape(T, H, 2 * D)  # per head: query then output gate
        gate = qg[..., D:].reshape(T, H * D)
        q = ops.rms_norm(qg[..., :D], self.q_norm, a.rms_norm_eps, 1.0)
        k = ops.rms_norm(k.reshape(T, Hkv, D), self.k_norm, a.rms_norm_eps, 1.0)
        v = v.reshape(T, Hkv, D)
        cos, sin = rope
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        if isinstance(state, Segmented):  # several sequences: each attends over its own cache
            o = ops.attention_segments(q, k, v, state.states, state.starts, state.spans, D ** -0.5)
        else:
            o = ops.attention(q, k, v, state, start, D ** -0.5)
        return ops.linear(o.reshape(T, H * D) * ops.sigmoid(gate), self.o)


class GatedDeltaNet:
    def __init__(self, a, w, ops):
        self.a, self.ops = a, ops
        self.qkv, self.z = w("linear_attn.in_proj_qkv.weight"), w("linear_attn.in_proj_z.weight")
        self.in_a, self.in_b = w("linear_attn.in_proj_a.weight"), w("linear_attn.in_proj_b.weight")
        self.out = w("linear_attn.out_proj.weight")
        conv = w("linear_attn.conv1d.weight")  # (C, 1, K)
        self.conv = conv.reshape(conv.shape[0], conv.shape[-1])
        self.neg_a = ops.exp(w("linear_attn.A_log")) * -1.0  # (Hv,)
        self.dt_bias, self.norm = w("linear_attn.dt_bias"), w("linear_attn.norm.weight")

    def new_state(self, ctx: int, kv):
        a = self.a
        return (self.ops.conv_state(self.conv.shape[0], a.linear_conv_kernel_dim),
                self.ops.delta_state(a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim))

    def __call__(self, h, state, start: int, rope):
        a, ops, T = self.a, self.ops, h.shape[0]
        Hk, Dk = a.linear_num_key_heads, a.linear_key_head_dim
        Hv, Dv = a.linear_num_value_heads, a.linear_value_head_dim
        qkv, z, b, a_in = ops.linear_group(h, [self.qkv, self.z, self.in_b, self.in_a])
        trail = None if isinstance(state, Segmented) else speculative.trail()
        if not isinstance(state, Segmented) and trail is None and not (a.llama_cpp_layout and Hv != Hk):
            # one sequence, nothing kept: conv, recurrence (its gates computed by the op) and gated norm in one op,
            # which a backend may run as one kernel for a decode step
            o = ops.gated_delta_net(qkv, self.conv, state[0], a_in, b, self.neg_a, self.dt_bias, state[1], z,
                                    self.norm, a.rms_norm_eps, (Hk, Dk, Hv, Dv))
            return ops.linear(o.reshape(T, Hv * Dv), self.out)
        if isinstance(state, Segmented):  # several sequences: each convolves and recurs over its own state
            x = ops.causal_conv1d_segments(qkv, self.conv, [st[0] for st in state.states], state.spans)
        elif trail is not None:  # a speculative verify: one token at a time, the state after each one kept
            x, states = ops.causal_conv1d_kept(qkv, self.conv, state[0])
            speculative.keep_all(trail, state[0], states)
        else:
            x = ops.causal_conv1d(qkv, self.conv, state[0])  # (T, 2*Hk*Dk + Hv*Dv)
        kd = Hk * Dk
        q, k = x[:, :kd].reshape(T, Hk, Dk), x[:, kd:2 * kd].reshape(T, Hk, Dk)
        v = x[:, 2 * kd:].reshape(T, Hv, Dv)
        if a.llama_cpp_layout and Hv != Hk:
            # llama.cpp's converter tiles the V heads over the K heads ([K0 K1 .. K0 K1 ..]) where HF groups them by
            # K head; every per-V-head weight (qkv's V rows, z, a, b, A_log, dt_bias, conv channels, out_proj's
            # columns) is in that order, so only the pairing changes: V head j reads K head j mod Hk. The K heads
            # are repeated in that order (the op then pairs head j with head j).
            q = q.reshape(T, 1, kd).repeat(Hv // Hk, axis=1).reshape(T, Hv, Dk)
            k = k.reshape(T, 1, kd).repeat(Hv // Hk, axis=1).reshape(T, Hv, Dk)
        if isinstance(state, Segmented) or trail is not None:
            g, beta = ops.gdn_gates(a_in, b, self.neg_a, self.dt_bias)  # log decay (<= 0), write strength (T, Hv)
        if isinstance(state, Segmented):
            o = ops.gated_delta_rule_segments(q, k, v, g, beta, [st[1] for st in state.states], state.spans)
        elif trail is not None:
            o, states = ops.gated_delta_rule_kept(q, k, v, g, beta, state[1])
            speculative.keep_all(trail, state[1], states)
        else:  # (T, Hv, Dv); the gates (gdn_gates of a, b) computed by the op, in its decode kernel where it has one
            o = ops.gated_delta_rule_gates(q, k, v, a_in, b, self.neg_a, self.dt_bias, state[1])
        o = ops.rms_norm_gated(o, z.reshape(T, Hv, Dv), self.norm, a.rms_norm_eps)
        return ops.linear(o.reshape(T, Hv * Dv), self.out)


class DenseMLP:
    def __init__(self, w, ops, prefix: str = "mlp."):
        self.ops = ops
        self.gate, self.up, self.down = (w(f"{prefix}{n}_proj.weight") for n in ("gate", "up", "down"))

    def __call__(self, h):
        ops = self.ops
        return ops.linear(ops.silu_mul(*ops.linear_group(h, [self.gate, self.up])), self.down)


class MoEMLP:
    """Router + shared expert on the layer's backend; routed experts on the experts component's backend."""

    def __init__(self, a, w, backend, ew, experts_backend, layer_prefix: str):
        self.a, self.backend, self.ops = a, backend, backend.ops
        self.ebackend, self.eops = experts_backend, experts_backend.ops
        self.router = w("mlp.gate.weight")
        self.shared = DenseMLP(w, self.ops, "mlp.shared_expert.")
        self.shared_gate = w("mlp.shared_expert_gate.weight")
        p = layer_prefix + "mlp.experts."
        E = a.num_experts
        self.gate_up = [(ew[f"{p}{e}.gate_proj.weight"], ew[f"{p}{e}.up_proj.weight"]) for e in range(E)]
        self.down = [ew[f"{p}{e}.down_proj.weight"] for e in range(E)]
        # routed experts on the layer's own backend: the shared expert goes with them as expert E (ops.moe_shared),
        # the lists built once so a backend can keep what it derives from them
        self.fused = experts_backend is backend
        if self.fused:
            s = self.shared
            self.gate_up_shared, self.down_shared = [*self.gate_up, (s.gate, s.up)], [*self.down, s.down]

    def __call__(self, h):
        ops = self.ops
        router, shared_gate = ops.linear_group(h, [self.router, self.shared_gate])
        if self.fused:
            return ops.moe_shared(h, router, shared_gate, self.a.num_experts_per_tok, self.gate_up_shared,
                                  self.down_shared)
        weights, ids = ops.moe_route(router, self.a.num_experts_per_tok, True)
        shared = self.shared(h) * ops.sigmoid(shared_gate)
        # on the experts' backend (from a GPU to the CPU and back: Backend.call, a host node of a captured step)
        return self.backend.call(self.ebackend, self._routed, h, ids, weights) + shared

    def _routed(self, h, ids, weights):
        return self.eops.moe_experts(h, ids, weights, self.gate_up, self.down)


class DecoderLayer:
    def __init__(self, arch, i: int, weights, backends):
        a, p = arch.args, f"{arch.prefix}layers.{i}."
        self.backend = backends[("layer", i)]
        # the token mixer computes where model.attention puts it (its own backend), else with the layer
        self.mixer_backend = backends.get(("attention", i), self.backend)
        w = _w(weights[("layer", i)], p)
        self.mixer_backend.use()  # what the mixer precomputes (exp(A_log)) goes to its own device
        mixer = GatedDeltaNet if a.layer_types[i] == "linear_attention" else FullAttention
        self.mixer = mixer(a, w, self.mixer_backend.ops)
        self.backend.use()
        ops = self.backend.ops
        self.a, self.ops = a, ops
        self.in_norm, self.post_norm = w("input_layernorm.weight"), w("post_attention_layernorm.weight")
        if ("experts", i) in weights:
            self.mlp = MoEMLP(a, w, self.backend, weights[("experts", i)], backends[("experts", i)], p)
        else:
            self.mlp = DenseMLP(w, ops)

    def __call__(self, x, state, start: int, rope):
        """``rope(backend)``: the rope tables of this forward's positions on that backend."""
        x, m = self.deferred(x, None, state, start, rope)
        return x + m

    def deferred(self, x, r, state, start: int, rope):
        """The layer on ``x + r`` (``r``: the previous layer's MLP output, not yet added; None: ``x`` is whole),
        its own last residual add left to the caller: -> ``(x', m)``, the layer's output being ``x' + m``. The add
        of ``r`` and the input norm are one ``ops.add_rms_norm`` (one kernel on cuda instead of two)."""
        ops, eps = self.ops, self.a.rms_norm_eps
        if r is None:
            h = ops.rms_norm(x, self.in_norm, eps, 1.0)
        else:
            x, h = ops.add_rms_norm(x, r, self.in_norm, eps, 1.0)
        if self.mixer_backend is self.backend:
            m = self.mixer(h, state, start, rope(self.backend))
        else:  # on the mixer's backend, where its state lives (Backend.call brings h there and the result back)
            m = self.backend.call(self.mixer_backend, lambda h: self.mixer(h, state, start, rope(self.mixer_backend)),
                                  h)
        x, h = ops.add_rms_norm(x, m, self.post_norm, eps, 1.0)  # x + m, and its norm
        return x, self.mlp(h)


class QwenModel(Model):
    records_states = True  # GatedDeltaNet keeps its state after each token of a verify (lumen_core.speculative)

    def __init__(self, arch, weights, backends, kv):
        self.arch, self.args = arch, arch.args
        self.vocab_size = arch.args.vocab_size
        self.kv = kv
        p = arch.prefix
        self.in_backend = backends[("input-layer", None)]
        self.embed = weights[("input-layer", None)][p + "embed_tokens.weight"]
        self.out_backend = backends[("output-layer", None)]
        out = weights[("output-layer", None)]
        self.norm = out[p + "norm.weight"]
        self.head = out[p + "embed_tokens.weight" if arch.args.tie_word_embeddings else "lm_head.weight"]
        self.layers = [DecoderLayer(arch, i, weights, backends) for i in range(arch.num_layers)]
        self.inv_freq = arch.args.inv_freq()
        rope = arch.args.rope_parameters
        self.mrope_section = list(rope.get("mrope_section") or [11, 11, 10])  # transformers' default
        self.image_token_id = arch.image_token_id
        self.vision_backend, self.tower = backends.get(("vision", None)), None
        if ("vision", None) in weights:
            from .vision import VisionTower

            self.tower = VisionTower(arch.vision_args, weights[("vision", None)], self.vision_backend,
                                     arch.visual_prefix)
        self.mtp = None  # the multi-token-prediction head (lumen_models_qwen.mtp), when loaded (arch.use_mtp)
        if ("mtp", None) in weights:
            from .mtp import MTPHead

            self.mtp = MTPHead(self, weights[("mtp", None)], backends[("mtp", None)])

    def new_cache(self, context_size: int) -> Cache:
        states = []
        for layer in self.layers:
            layer.mixer_backend.use()  # the layer's cache on its mixer's device (several GPUs in one plan)
            states.append(layer.mixer.new_state(context_size, self.kv))
        return Cache(context_size, states)

    # -- vision (issue 17) ------------------------------------------------------------------------------------
    def encode_images(self, images: list) -> list:
        """Each ``ImageInput`` through the tower on the vision backend: ``(num_tokens, hidden_size)`` each."""
        if self.tower is None:
            raise NotImplementedError("this Qwen model was loaded without its vision tower (no vision block)")
        out = []
        for i, image in enumerate(images):
            try:
                self.tower.check(image)
            except ValueError as exc:
                raise InputError(f"image {i + 1}: {exc}") from None
            out.append(self.tower.encode(image))
        return out

    def _image_runs(self, ids, images) -> list[tuple[int, int, tuple]]:
        """``(first, end, grid)`` of each image's tokens in ``ids``, in order: each image takes the next
        ``num_tokens`` image pads, which must be consecutive."""
        pad, runs, i, n = self.image_token_id, [], 0, len(ids)
        for image, emb in images:
            while i < n and ids[i] != pad:
                i += 1
            end = i + image.num_tokens
            if i == n or end > n or any(t != pad for t in ids[i:end]) or emb.shape[0] != image.num_tokens:
                raise InputError(f"image {len(runs) + 1} of this forward has {image.num_tokens} tokens, but the "
                                 f"ids hold no run of that many image pads (id {pad}) for it in order (expand the "
                                 "prompt with expand_image_tokens)")
            runs.append((i, end, tuple(int(g) for g in image.grid)))
            i = end
        if any(t == pad for t in ids[i:]):
            raise InputError(f"the ids hold more image pads (id {pad}) than the {len(images)} image(s) given cover")
        return runs

    def _mrope_positions(self, start: int, T: int, runs) -> tuple[list[list[int]], int]:
        """transformers' ``get_rope_index`` from rope position ``start``: text advances 1 a token on all three
        axes, an image's merged (t, h, w) grid takes (start + t, start + row, start + col), and what follows it
        starts at start + max(rows, cols). -> the (3, T) positions and the rope position of the token after."""
        m = self.arch.vision_args.spatial_merge_size
        rows: list[list[int]] = [[], [], []]
        cur, i = start, 0
        for first, end, (t, h, w) in runs:
            for r in rows:  # the text before the image
                r.extend(range(cur, cur + first - i))
            cur += first - i
            gh, gw = h // m, w // m
            for ti in range(t):
                for y in range(gh):
                    for x in range(gw):
                        rows[0].append(cur + ti)
                        rows[1].append(cur + y)
                        rows[2].append(cur + x)
            cur, i = cur + max(gh, gw), end
        for r in rows:
            r.extend(range(cur, cur + T - i))
        cur += T - i
        return rows, cur

    def _layers(self, x, states, start, rope):
        """``x`` through every layer. Each layer's last residual add goes into the next layer's input norm
        (``DecoderLayer.deferred``) where the two share a backend; else it is added on the layer's own. -> ``(x, r)``
        on the last layer's backend, the last layer's output being ``x + r``."""
        r = prev = None
        for layer, state in zip(self.layers, states, strict=True):
            if r is not None and layer.backend is not prev:
                x, r = x + r, None  # on the previous layer's backend (its device is still current)
            x = layer.backend.take(x)  # first: it makes the layer's device current
            x, r = layer.deferred(x, r, state, start, rope)
            prev = layer.backend
        return x, r

    def forward_batch(self, segments):
        """Several sequences in one pass (``Model.forward_batch``): the rows of every segment go through each
        projection, norm and MLP together; attention and the Gated-DeltaNet step run per sequence on its cache."""
        ids, spans, positions, caches = [], [], [], []
        for seg, cache in segments:
            if cache.pos == 0:
                cache.rope_offset = 0
            first = cache.pos + cache.rope_offset
            spans.append((len(ids), len(ids) + len(seg)))
            ids += list(seg)
            positions += range(first, first + len(seg))
            caches.append(cache)
        self.in_backend.use()
        x = self.in_backend.ops.embedding(ids, self.embed)
        ropes = {}

        def rope(b):
            if b not in ropes:
                ropes[b] = b.ops.rope_tables(positions, self.inv_freq)
            return ropes[b]

        starts = [c.pos for c in caches]
        x, r = self._layers(x, [Segmented(spans, [c.layers[i] for c in caches], starts)
                                for i in range(len(self.layers))], None, rope)
        x = x + r
        for (first, end), cache in zip(spans, caches, strict=True):
            cache.pos += end - first
        ob = self.out_backend
        x = ob.take(x)
        x = x[-1:] if len(spans) == 1 else ob.ops.concat([x[end - 1:end] for _, end in spans])
        x = ob.ops.rms_norm(x, self.norm, self.args.rms_norm_eps, 1.0)
        return ob.to_host(ob.ops.linear(x, self.head))

    def forward(self, ids, cache: Cache, all_logits: bool = False, host: bool = True, images=None,
                hidden: bool = False):
        """Logits of the last row (every row with ``all_logits``). ``hidden``: return ``(logits, rows)``, where rows
        are all T final-normed hidden states (T, H) on the output layer's backend (what the MTP head reads)."""
        start, T = cache.pos, len(ids)
        self.in_backend.use()  # a forward starts on the input layer's device (several GPUs in one plan)
        x = self.in_backend.ops.embedding(ids, self.embed)  # (T, H)
        if start == 0:
            cache.rope_offset = 0  # a new sequence
        if images:
            runs = self._image_runs(ids, images)
            ops, parts, i = self.in_backend.ops, [], 0
            for (first, end, _), (_, emb) in zip(runs, images, strict=True):
                parts += [x[i:first], self.in_backend.take(emb)] if first > i else [self.in_backend.take(emb)]
                i = end
            x = ops.concat(parts + [x[i:]] if i < T else parts)
            positions, after = self._mrope_positions(start + cache.rope_offset, T, runs)
            cache.rope_offset = after - (start + T)
            section = self.mrope_section

            def tables(b):
                return b.ops.rope_tables(positions, self.inv_freq, section, True)
        else:
            first = start + cache.rope_offset
            positions = list(range(first, first + T))

            def tables(b):
                return b.ops.rope_tables(positions, self.inv_freq)
        ropes = {}

        def rope(b):  # called with b's device current (after b.take), where the tables go
            if b not in ropes:
                ropes[b] = tables(b)
            return ropes[b]

        x, r = self._layers(x, cache.layers, start, rope)
        cache.pos += T
        ob, eps = self.out_backend, self.args.rms_norm_eps
        if not (all_logits or hidden):
            x, r = x[T - 1:], r[T - 1:]
        if ob is self.layers[-1].backend:  # the last residual add and the final norm in one op
            x = ob.ops.add_rms_norm(x, r, self.norm, eps, 1.0)[1]
        else:
            x = ob.ops.rms_norm(ob.take(x + r), self.norm, eps, 1.0)
        logits = ob.ops.linear(x if all_logits or not hidden else x[T - 1:], self.head)
        logits = ob.to_host(logits) if host else logits
        return (logits, x) if hidden else logits
