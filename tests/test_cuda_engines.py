"""Several engines on one GPU in one process (issue 18: state belongs to the engine, not to modules).

The CUDA backend keeps what a model needs (the pinned arena, the VRAM expert cache, decode graphs, fused weights,
pointer tables, the step being captured) on objects one engine owns: its ``CUDABackend`` instance, its runner,
its Weights. So:

- two different models (a dense Qwen 3.5 in VRAM, a Qwen 3.5 MoE streaming its experts from host RAM through its
  own expert cache, a Gemma 3) generating token by token in turn give exactly the greedy tokens each gives alone,
  with their decode steps captured as CUDA graphs (two replays queued per engine) and op by op;
- a main model and a draft of the same family and the same expert shapes (what a shared per-shape buffer would
  mix up) likewise;
- closing and dropping one engine gives back its VRAM (CuPy's pool: within 1 MiB; the device, once CuPy's free
  blocks are released: within 64 MiB the first time, for the kernels its model was the first to load, and within
  8 MiB on a second load and drop; checked only where the test process has the GPU to itself, not under
  pytest-xdist, whose other workers move the device's free memory) and all of its page-locked memory (its
  arena's ``live`` bytes reach 0), and the other engine still generates what it did. On the H200 (2026-12): the
  streamed MoE engine held 5.2 MiB of CuPy's pool and 12.0 MiB pinned; after close + del 0.000 MiB and 0 B were
  left, and the device's free memory was back to the byte (0.0 MiB) after each of two loads and drops.
- a suspended ``generate_tokens`` leaves the caller's current CUDA stream alone: the pipelined greedy decode used
  to yield inside ``with runner.stream``, so the next engine's prefill and greedy kernel were queued on the first
  engine's stream, out of order with its replays (tokens repeated; found by these tests, fixed in graph.py).

Without a GPU (CI): the package's modules import each other in the order ``lumen_cuda.MODULE_ORDER`` gives (no
cycle), no module keeps state in a global (only the documented compiled-kernel caches and the host-call registry),
each backend's op set binds the ops that need their backend to that backend, and Weights carry their store.

GPU tests carry the ``gpu`` marker and skip without CuPy or a CUDA device, as every tests/test_cuda_*.py does.
"""

from __future__ import annotations

import ast
import gc
import os
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import lumen_core as lumen
from lumen_core.backend import Weight
from lumen_core.plugins import get_registry

lumen_cuda = pytest.importorskip("lumen_cuda")

PACKAGE = Path(lumen_cuda.__file__).parent
CONTEXT = 128
TOKENS = 16
MiB = 1 << 20


# -- no GPU needed ---------------------------------------------------------------------------------------------------
def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))}


def _imports(tree: ast.Module, modules) -> set[str]:
    """The package's modules ``tree`` imports, at its top or inside a function (``from . import x``,
    ``from .x import y``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            out.update(n for n in names if n in modules)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lumen_cuda."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("lumen_cuda."))
    return out


def test_the_cuda_modules_import_in_the_documented_order_without_a_cycle():
    modules = _modules()
    order = list(lumen_cuda.MODULE_ORDER)
    assert sorted(order) == sorted(modules), "MODULE_ORDER must list every module of lumen_cuda once"
    late = {m: sorted(d for d in _imports(tree, modules) if order.index(d) >= order.index(m))
            for m, tree in modules.items()}
    assert not {m: d for m, d in late.items() if d}, f"modules importing a module not before them: {late}"


# Module-level names allowed to hold something that changes at run time: process-wide caches of compiled code and
# device facts (kernels.py says why), the registry the host-node trampoline looks calls up in (weak references,
# hostcall.py), and the context variable a runner sets while it prepares its step (step.py).
PROCESS_WIDE = {("kernels", "_MODULES"), ("kernels", "_FUNCTIONS"), ("kernels", "_ATTRIBUTES"),
                ("kernels", "_CONSTANTS"), ("hostcall", "_CALLS"), ("hostcall", "_KEYS"), ("hostcall", "_driver"),
                ("step", "_CURRENT")}


def _mutable_globals(name: str, tree: ast.Module) -> list[str]:
    """Module-level names bound to an empty container or None (a cache or a slot filled later), to a weak or default
    dict, a counter or a context variable; and names a ``global`` statement rebinds."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        empty = isinstance(value, ast.Dict | ast.List | ast.Set) and not (
            getattr(value, "keys", None) or getattr(value, "elts", None))
        none = isinstance(value, ast.Constant) and value.value is None
        call = isinstance(value, ast.Call) and any(
            k in ast.unparse(value.func) for k in ("dict", "list", "set", "Weak", "count", "ContextVar", "deque"))
        if empty or none or call:
            found += [ast.unparse(t) for t in targets]
    found += [n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names]
    return found


def test_no_cuda_module_keeps_state_in_a_global():
    """Per-model and per-step state lives on the backend, the runner or the Weights, never in a module; and nothing
    is keyed by ``id()`` (a freed object's id is reused)."""
    modules = _modules()
    found = {(m, n) for m, tree in modules.items() for n in _mutable_globals(m, tree)}
    assert found - PROCESS_WIDE == set(), f"module-level state: {sorted(found - PROCESS_WIDE)}"
    ids = sorted(m for m, tree in modules.items() for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "id")
    assert not ids, f"id() used in {ids}"


@pytest.fixture
def standin_cupy(monkeypatch):
    """CUDABackend without CuPy or a GPU: the backend's CuPy is a stand-in (it only names a device)."""
    from lumen_cuda import backend as cb

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda i: ("device", i)))
    monkeypatch.setattr(cb, "_load_cupy", lambda: (fake, None))
    monkeypatch.setattr(cb, "_cupy", lambda: fake)
    return cb.CUDABackend


def test_each_backend_binds_the_ops_that_need_it_to_itself(standin_cupy):
    """The MoE expert ops reach their backend's expert cache through ``backend=``, bound by that backend's op set
    (two engines' backends: two bindings); other ops resolve to the registered function itself."""
    registry = get_registry()
    a, b = standin_cupy("cuda:0", registry), standin_cupy("cuda:0", registry)
    for op in lumen_cuda.BACKEND_OPS:
        fa, fb = a.ops.resolve(op), b.ops.resolve(op)
        assert fa.keywords == {"backend": a} and fb.keywords == {"backend": b}
        assert fa.func is registry.op(op, "cuda")
    assert a.ops.resolve("linear", "bf16") is registry.op("linear", "cuda", "bf16")
    assert a.arena is not b.arena and a._streams is None  # the expert cache is made when first asked for


def test_state_derived_from_a_weight_lives_on_it():
    """lumen_cuda.state: a Weight's derived CUDA state is its own dict, ignored by == and not carried over by
    dataclasses.replace (Gemma's halves of a matrix start with none)."""
    from lumen_cuda.state import derived

    w = Weight(np.zeros((2, 2), np.float32), "f32", (2, 2), store="vram")
    derived(w)["view"] = "something"
    assert derived(w) == {"view": "something"}
    assert derived(replace(w, data=w.data[:1], shape=(1, 2))) == {}
    assert w == Weight(w.data, "f32", (2, 2), store="vram")


def test_loaded_weights_carry_their_store(tiny_checkpoint):
    """Every matrix the loader puts on a backend says where it is kept (the CPU backend's too)."""
    engine = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "compute": "cpu", "store": "ram"}},
                        progress=False)
    matrices = [w for comp in engine.weights.values() for w in comp.values() if isinstance(w, Weight)]
    assert matrices and {w.store for w in matrices} == {"ram"}


# -- on the GPU ------------------------------------------------------------------------------------------------------
def load(path, experts=None):
    hidden = {"kv-cache": {"context-size": CONTEXT}}
    if experts:
        hidden["experts"] = experts
    return lumen.load({"model": {"path": str(path), "compute": "cuda:0", "store": "vram", "hidden-layers": hidden}},
                      progress=False)


def close(engine) -> None:
    """Engine.close where the engine has one; else each of its backends' close (what Engine.close does)."""
    if hasattr(engine, "close"):
        engine.close()
        return
    for backend in {id(b): b for b in engine.backends.values()}.values():
        backend.close()


def prompt(seed: int, n: int = 24) -> list[int]:
    return np.random.RandomState(seed).randint(5, 900, n).tolist()


def interleaved(engines, prompts) -> list[list[int]]:
    """Each engine's greedy tokens, generated one token from each engine in turn (each generator pipelines its own
    graph replays, so the engines' steps are queued on the GPU together). A suspended generator leaves the caller's
    current CUDA stream as it found it (a runner's stream left current would take the next engine's work)."""
    import cupy as cp

    gens = [e.generate_tokens(p, TOKENS) for e, p in zip(engines, prompts, strict=True)]
    out = [[] for _ in gens]
    live = set(range(len(gens)))
    stream = cp.cuda.get_current_stream().ptr
    while live:
        for i in sorted(live):
            tok = next(gens[i], None)
            assert cp.cuda.get_current_stream().ptr == stream
            if tok is None:
                live.discard(i)
            else:
                out[i].append(tok)
    return out


def check_interleaved(engines, prompts) -> None:
    alone = [list(e.generate_tokens(p, TOKENS)) for e, p in zip(engines, prompts, strict=True)]
    assert all(alone)
    assert interleaved(engines, prompts) == alone
    assert interleaved(engines[::-1], prompts[::-1]) == alone[::-1]
    assert [list(e.generate_tokens(p, TOKENS)) for e, p in zip(engines, prompts, strict=True)] == alone


@pytest.fixture(params=["graph", "op-by-op"])
def decode_mode(request, monkeypatch, cp):
    if request.param == "op-by-op":
        monkeypatch.setenv("LUMEN_CUDA_GRAPH", "0")
    return request.param


@pytest.mark.gpu
def test_different_models_generate_interleaved_what_each_generates_alone(tiny_checkpoint, decode_mode, monkeypatch):
    from lumen_cuda import stream

    monkeypatch.setattr(stream, "REFRESH", 1)  # the streamed engine swaps experts while the others run
    dense = load(tiny_checkpoint("qwen3_5"))
    streamed = load(tiny_checkpoint("qwen3_5_moe"), {"compute": "cuda:0", "store": "ram", "cache": 2})
    gemma = load(tiny_checkpoint("gemma3"))
    engines = [dense, streamed, gemma]
    if decode_mode == "graph":
        assert dense.decode_runner() and streamed.decode_runner()
    check_interleaved(engines, [prompt(1), prompt(2), prompt(3)])
    cuda = [e.backends[("output-layer", None)] for e in engines]
    assert len({id(b) for b in cuda}) == 3 and len({id(b.arena) for b in cuda}) == 3
    assert cuda[1].expert_stats()["copied_bytes"] > 0 and cuda[0].expert_stats() is None


@pytest.mark.gpu
def test_a_main_model_and_its_draft_generate_interleaved_what_each_generates_alone(tiny_checkpoint, decode_mode):
    """Same family, different sizes, the same expert shapes (k, I): each layer keeps its own decode scratch."""
    main = load(tiny_checkpoint("qwen3_5_moe"))
    draft = load(tiny_checkpoint("qwen3_5_moe", num_hidden_layers=2, hidden_size=32))
    if decode_mode == "graph":
        assert main.decode_runner() and draft.decode_runner()
    check_interleaved([main, draft], [prompt(4), prompt(4)])


@pytest.mark.gpu
def test_closing_and_dropping_an_engine_gives_back_its_vram_and_pinned_memory(tiny_checkpoint, cp):
    pool, pinned_pool = cp.get_default_memory_pool(), cp.get_default_pinned_memory_pool()
    keep = load(tiny_checkpoint("qwen3_5"))
    p_keep, p_drop = prompt(5), prompt(6)
    want = list(keep.generate_tokens(p_keep, TOKENS))  # its graph, greedy buffers, fused weights: made before

    def free_device_bytes() -> int:
        gc.collect()
        pool.free_all_blocks()
        pinned_pool.free_all_blocks()
        return cp.cuda.runtime.memGetInfo()[0]

    def load_run_drop(label: str) -> tuple[int, int]:
        used0 = pool.used_bytes()
        engine = load(tiny_checkpoint("qwen3_5_moe", hidden_size=256, moe_intermediate_size=128),
                      {"compute": "cuda:0", "store": "ram", "cache": 4})
        got = interleaved([keep, engine], [p_keep, p_drop])
        assert got[0] == want and engine.decode_runner()
        backend = engine.backends[("output-layer", None)]
        arena, held = backend.arena, pool.used_bytes() - used0
        pinned = arena.live
        assert held > 0 and pinned > 0 and backend.expert_stats()["copied_bytes"] > 0
        close(engine)
        del engine, backend
        gc.collect()
        left = pool.used_bytes() - used0
        print(f"{label}: the engine held {held / MiB:.1f} MiB of VRAM (CuPy's pool, graph pool aside) and "
              f"{pinned / MiB:.1f} MiB pinned; after close + del: {left / MiB:.3f} MiB VRAM, {arena.live} B pinned")
        assert left <= 1 * MiB, left
        assert arena.live == 0
        return held, pinned

    free0 = free_device_bytes()
    load_run_drop("first load")
    free1 = free_device_bytes()
    load_run_drop("second load")
    free2 = free_device_bytes()
    print(f"device free memory: {(free0 - free1) / MiB:.1f} MiB less after the first load and drop, "
          f"{(free1 - free2) / MiB:.1f} MiB after the second")
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the device's free memory is this process's alone to move
        assert free0 - free1 <= 64 * MiB
        assert free1 - free2 <= 8 * MiB
    assert list(keep.generate_tokens(p_keep, TOKENS)) == want
