"""Qwen 3.5's multi-token-prediction (MTP) head: a one-layer model that drafts the token after next.

As vLLM runs Qwen3-Next / Qwen 3.5's MTP (which Lumen follows). Row i of a call pairs a token ``x[i]`` with the
hidden state ``h[i]`` of the position where ``x[i]`` was predicted (the main model's final-normed row, the one its
lm_head read, or for a later draft step the head's own ``out`` row)::

    e = embed_tokens(x)                                               (the main model's embedding)
    y = fc(concat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)))   (embedding half first)
    y = decoder layer(y)        full attention over the head's own KV cache, RoPE at its cache positions; MLP/MoE
    out = norm(y);  logits = lm_head(out)                             (the main model's head)

The head is the component ``("mtp", None)`` (placed with the output layer); its embedding lookup runs on the input
layer's backend and its lm_head on the output layer's, so neither table is held twice.
"""

from __future__ import annotations

from lumen_core.errors import InputError

from .model import Cache, DecoderLayer, DenseMLP, FullAttention, MoEMLP, _w

PREFIX = "mtp."


class MTPLayer(DecoderLayer):
    """The head's decoder layer (``mtp.layers.0.*``): a full-attention layer whose mixer, norms and MLP (dense, or
    the MoE block with its routed experts on the same backend) all compute on the head's backend. Its forward is
    ``DecoderLayer``'s."""

    def __init__(self, a, weights: dict, prefix: str, backend):
        self.a, self.backend, self.mixer_backend = a, backend, backend
        backend.use()
        ops = self.ops = backend.ops
        w = _w(weights, prefix)
        self.mixer = FullAttention(a, w, ops)
        self.in_norm, self.post_norm = w("input_layernorm.weight"), w("post_attention_layernorm.weight")
        if a.num_experts:
            self.mlp = MoEMLP(a, w, backend, weights, backend, prefix)
        else:
            self.mlp = DenseMLP(w, ops)


class MTPHead:
    """``model.mtp`` of a Qwen model loaded with its MTP head (``arch.use_mtp``). ``new_cache`` makes the head's own
    cache (one KV cache); ``forward`` runs rows through the head (see the module's docstring)."""

    def __init__(self, model, weights: dict, backend):
        a = model.args
        self.model, self.a, self.backend, self.ops = model, a, backend, backend.ops
        backend.use()
        w = _w(weights, PREFIX)
        self.fc = w("fc.weight")  # (H, 2H)
        self.norm_embedding, self.norm_hidden = w("pre_fc_norm_embedding.weight"), w("pre_fc_norm_hidden.weight")
        self.norm = w("norm.weight")
        self.layer = MTPLayer(a, weights, PREFIX + "layers.0.", backend)
        self.inv_freq = a.inv_freq()

    def new_cache(self, context_size: int) -> Cache:
        """The head's cache: its layer's KV cache for ``context_size`` rows, on the head's device."""
        self.backend.use()
        return Cache(context_size, [self.layer.mixer.new_state(context_size, self.model.kv)])

    def forward(self, ids: list[int], hidden, cache: Cache, host: bool = True):
        """Run ``len(ids)`` rows at cache positions ``cache.pos..`` (``cache.pos`` advances by that many).

        ``ids`` (T,): the tokens; ``hidden`` (T, H): row i the hidden state of the position where ``ids[i]`` was
        predicted (a host numpy array or any backend's array). Returns ``(logits, out)``: the last row's logits
        (1, V) f32 (a numpy array with ``host``, else the output layer's backend array) and ``out`` (1, H), the last
        row after the head's final norm, on the head's backend: the ``hidden`` of the next draft step."""
        T = len(ids)
        if T == 0:
            raise InputError("MTPHead.forward got no tokens: pass at least one (token, hidden row) pair")
        if tuple(hidden.shape) != (T, self.a.hidden_size):
            raise InputError(f"MTPHead.forward got {T} token(s) but hidden rows of shape {tuple(hidden.shape)}: "
                             f"pass one hidden row per token, shape ({T}, {self.a.hidden_size})")
        if cache.pos + T > cache.capacity:
            raise InputError(f"the MTP cache holds {cache.capacity} rows and has {cache.pos}: {T} more do not fit; "
                             "make it with new_cache(context_size) of the main cache's size")
        m, b, ops, eps = self.model, self.backend, self.ops, self.a.rms_norm_eps
        m.in_backend.use()
        e = b.take(m.in_backend.ops.embedding(ids, m.embed))  # (T, H): the main model's embedding
        h = b.take(hidden)
        x = ops.linear(self._pair(ops.rms_norm(e, self.norm_embedding, eps, 1.0),
                                  ops.rms_norm(h, self.norm_hidden, eps, 1.0)), self.fc)
        first = cache.pos + cache.rope_offset
        positions = list(range(first, first + T))
        tables = {}

        def rope(backend):
            if backend not in tables:
                tables[backend] = backend.ops.rope_tables(positions, self.inv_freq)
            return tables[backend]

        y = self.layer(x, cache.layers[0], cache.pos, rope)
        cache.pos += T
        out = ops.rms_norm(y[T - 1:], self.norm, eps, 1.0)
        ob = m.out_backend
        logits = ob.ops.linear(ob.take(out), m.head)
        return (ob.to_host(logits) if host else logits), out

    def _pair(self, e, h):
        """(T, 2H) rows ``[e_i, h_i]``. The op contract concatenates along the first axis only: ``[e; h]`` (2T, H)
        is read in the order e_0, h_0, e_1, h_1, ... (``gather``), which is (T, 2H) row-major."""
        T, H = e.shape
        both = self.ops.concat([e, h])
        if T > 1:
            both = self.ops.gather(both, [i + T * half for i in range(T) for half in (0, 1)])
        return both.reshape(T, 2 * H)
