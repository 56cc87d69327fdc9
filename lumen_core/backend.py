"""The backend contract: devices, memory, weight upload, and op lookup.

A backend owns its tensors. Architecture code never imports numpy/cupy/wgpu: it calls ``ops.<name>(...)``
and uses only the small tensor protocol every backend's arrays support (see ``docs/ops.md``):
``.shape``, ``.reshape``, basic slicing, ``+ - * /`` with tensors and Python scalars.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from .errors import PlanError


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # "cpu", "cuda:0"
    total_bytes: int
    free_bytes: int
    description: str = ""


@dataclass
class Weight:
    """A weight matrix on a backend, in a storage format; ops dispatch on ``format``."""

    data: Any  # backend array (fp8: the e4m3 values; GGUF block formats: raw blocks (rows, bytes/row))
    format: str  # "f32", "f16", "bf16", "fp8", or a GGUF type in lower case ("q4_k", "q8_0", ...)
    shape: tuple[int, ...]
    scale: Any = None  # fp8: per-block / per-channel / per-tensor scale (backend array)
    block: tuple[int, int] | None = None  # fp8 block size, e.g. (128, 128); None = per-channel/tensor
    # where the backend keeps ``data`` ("vram", "ram", ...: the plan's store), set by the backend that made it; None
    # where unknown (a Weight made by hand). Ops read it to choose a path instead of inferring it from the array type
    store: str | None = None
    # the activations a backend's several-token (prefill) products with this weight take: "f32" (exact, the
    # default) or "bf16" (rounded to bf16 first: ``cuda.compute-quantization``), set by the backend that made it
    activations: str = "f32"

    @property
    def nbytes(self) -> int:
        n = int(getattr(self.data, "nbytes", 0))
        return n + int(getattr(self.scale, "nbytes", 0) if self.scale is not None else 0)


def scale_block(shape, scale_shape) -> tuple[int, int] | None:
    """The block size an FP8 scale's shape implies for a (rows, cols) weight: (BR, BC) powers of two for block
    scales (HF's ``weight_scale_inv``, e.g. 128x128), or None for per-channel ((N,) / (N, 1)) and per-tensor
    scales. Every backend infers it the same way, so a Weight means the same numbers everywhere."""
    per_tensor = all(d == 1 for d in scale_shape)
    per_channel = len(scale_shape) >= 1 and scale_shape[0] == shape[0] and all(d == 1 for d in scale_shape[1:])
    if len(scale_shape) == 2 and not per_tensor and not per_channel:
        return (_block_len(shape[0], scale_shape[0]), _block_len(shape[1], scale_shape[1]))
    return None


def _block_len(n: int, blocks: int) -> int:
    b = 1
    while -(-n // b) > blocks:
        b *= 2
    return b


class Backend(ABC):
    """One device of one backend kind. Subclasses register through ``register_backends``."""

    name: str = ""
    stores: tuple[str, ...] = ()  # the weight stores this backend can compute from
    expert_stores: tuple[str, ...] = ()  # further stores it can compute routed experts from (streamed)
    kv_types: tuple[str, ...] = ("f32",)  # KV-cache element types it can keep
    kv_stores: tuple[str, ...] = ("ram",)  # memories it can keep a layer's KV cache in (kv-cache.store)
    # backends (by name) whose routed experts this one's decode runner can keep inside its replayed step, through
    # ``call`` (the CUDA backend: the CPU's, as nodes of its CUDA graph: native jobs (``host_jobs``) or host nodes)
    graph_guests: tuple[str, ...] = ()
    # kernels compiled on first use (numba): the engine runs one short forward while loading (`Engine.warm_up`)
    compiles_on_first_use: bool = False
    # its cache states can be saved to and restored from host arrays by lumen_core.prefix_cache (numpy / CuPy arrays)
    prefix_cache: bool = True
    # speculative decoding (a draft model or an MTP head, lumen_core.speculative) can run on it: its caches can be
    # copied and rewound to an earlier position after a rejected draft; the plan refuses a draft where it cannot
    speculative: bool = True

    def __init__(self, device: str, registry):
        self.device = device
        self.registry = registry
        self.ops = OpSet(self)

    @classmethod
    @abstractmethod
    def devices(cls) -> list[DeviceInfo]:
        """The devices of this kind present on this machine."""

    @abstractmethod
    def weight(self, array, fmt: str, store: str, scale=None, shape=None) -> Weight:
        """Put a host array (numpy, from the checkpoint reader) on this device as a Weight.

        ``shape`` is the logical (rows, cols) shape, which differs from ``array.shape`` for block-quantized
        formats (raw bytes per row)."""

    @classmethod
    def stored_format(cls, fmt: str, store: str = "ram") -> str:
        """The format this backend keeps a weight of checkpoint format ``fmt`` in, placed with ``store``: ``fmt``
        itself, unless the backend converts it on load (cuda: GGUF block formats to bf16; cpu, store ram: GGUF
        4-6-bit formats to int8 codes). The plan counts the stored bytes (``stored_nbytes``)."""
        return fmt

    # why ``stored_format`` converts (the plan's note says it)
    conversion_reason = "this backend has no kernel that reads them as stored"

    @classmethod
    def stored_nbytes(cls, fmt: str, shape: tuple, store: str) -> int | None:
        """Bytes a weight of checkpoint format ``fmt`` and logical ``shape`` takes once loaded with ``store``, where
        the backend's layout is not a plain dtype (None: the checkpoint's bytes, or ``stored_format``'s dtype)."""
        return None

    def configure_threads(self, threads: int) -> None:
        """Called before loading, on a backend that computes components of the plan, when the config sets its
        thread count (``cpu.threads``). Backends without a host thread pool are never called."""
        raise NotImplementedError(f"backend {self.name!r} has no thread pool to configure")

    def configure_compute_quantization(self, quantization: str) -> None:
        """Called before loading on the CPU backends with ``cpu.compute-quantization`` ("none", "int8" or "bf16") and
        on the cuda backends with ``cuda.compute-quantization`` ("none" or "bf16")."""
        if quantization != "none":
            raise NotImplementedError(f"backend {self.name!r} has no compute quantization {quantization!r}")

    # attention.compute-quantization values this backend computes (besides none / default / bf16, its own precision):
    # "fp8" = attention in FP8 MMA over an fp8 KV cache (lumen_cuda); the plan refuses it on a backend without it
    attention_quantizations: tuple[str, ...] = ()

    def configure_attention_quantization(self, quantization: str) -> None:
        """Called before the model is built on each backend that computes attention, with
        ``model.attention.compute-quantization`` when it names one of ``attention_quantizations`` ("fp8"): the KV
        caches the backend makes afterwards compute attention that way."""
        raise NotImplementedError(f"backend {self.name!r} has no attention compute quantization {quantization!r}")

    def compute_quantization_applies(self) -> bool:
        """After loading: whether the configured compute quantization found weights to apply to (the engine notes
        a setting that has no effect). The default: no compute quantization, nothing to say."""
        return True

    def release_threads(self) -> None:
        """Called on a thread that is about to wait while another thread computes on this backend (a GPU graph's
        host nodes run this backend's ops on a driver thread): free the calling thread's idle worker threads, if
        the backend keeps a pool per calling thread, so that they do not compete with the other thread's. The
        default does nothing."""
        return None

    def host_jobs(self):
        """None (the default), or what lets a GPU's captured decode step ask work of this backend from native
        threads, without Python: a module or object with ``record(fn, shapes)`` (the job ``fn`` amounts to on
        arguments of those (shape, dtype), or None), ``layout()`` (the mailbox's offsets and size),
        ``server_threads(threads)`` and ``Server(address, keep, threads)`` (lumen_cpu.hostjob is the one
        implementation; lumen_cuda/hostcall.py the one caller)."""
        return None

    def configure_expert_cache(self, slots: int | None) -> None:
        """Called before loading when routed experts compute here from one of ``expert_stores``: how many experts
        to keep resident (None: the backend's default). Backends with no ``expert_stores`` are never called."""
        raise NotImplementedError(f"backend {self.name!r} does not stream routed experts")

    @abstractmethod
    def tensor(self, array) -> Any:
        """Put a host array (f32 activations, small vectors, norm weights) on this device."""

    @abstractmethod
    def to_host(self, x) -> Any:
        """A numpy copy of a backend array."""

    def decode_runner(self, model, context_size: int):
        """A :class:`DecodeRunner` that replays ``model``'s one-token decode step without Python in the loop
        (the CUDA backend captures it as a CUDA graph), or None where this backend has none; raise
        NotImplementedError naming the reason where it has one but this model's step cannot use it. The engine
        asks when every component of a plan sits on this one backend instance."""
        return None

    def close(self) -> None:
        """Release what this backend instance holds beyond the arrays it handed out (caches, page-locked pools,
        captured graphs), now rather than when it is garbage-collected; the engine that owns it calls this when it
        is dropped, and does not compute on it afterwards. Default: nothing."""
        return None

    def use(self) -> None:
        """Make this device the one that new arrays and kernels go to until another backend's ``use`` or
        ``take``. Ops do not know their device (one registration serves every device of a backend): a GPU
        backend's ops allocate on the current device. A GPU backend's ``take`` calls it; an architecture calls
        it when it builds a layer (what the layer precomputes), before it makes a layer's cache (``new_cache``)
        and at the start of a forward. Default: nothing."""
        return None

    def take(self, x):
        """Bring an activation computed on another device here (identity when already here)."""
        return x if self.owns(x) else self.tensor(x if _is_numpy(x) else _host_of(x))

    def owns(self, x) -> bool:
        return _is_numpy(x)

    def call(self, target: Backend, fn, *args):
        """``fn(*args)`` computed on ``target`` (each argument brought there with ``target.take``), its result
        brought back here. ``fn`` returns an array of ``args[0]``'s shape (an architecture calls its routed
        experts on their own backend this way). A backend whose decode runner replays a captured step overrides
        this to keep the crossing inside the step (lumen_cuda.hostcall); the values are the same."""
        if target is self:
            return fn(*args)
        return self.take(fn(*(target.take(a) for a in args)))

    @classmethod
    def device_info(cls, device: str) -> DeviceInfo:
        for info in cls.devices():
            if info.name == device:
                return info
        names = ", ".join(i.name for i in cls.devices()) or "none"
        raise PlanError(f"device {device!r} does not exist on this machine (present: {names})")


class DecodeRunner(ABC):
    """One model's decode step, prepared once and replayed per token (see ``Backend.decode_runner``).

    ``cache`` is the runner's own cache (the step was prepared against its arrays): ``reset`` empties it for a
    new sequence, the engine prefills into it with ``model.forward(..., host=False)``, then calls ``step`` per
    token. ``sampler(params)`` draws tokens from the backend's logits without copying them to the host."""

    cache: Any

    @abstractmethod
    def reset(self) -> None:
        """Empty the cache (position 0, zero states)."""

    @abstractmethod
    def step(self, token: int) -> Any:
        """Run ``token`` at ``cache.pos`` (then advanced by one); return the backend's (1, vocab) logits."""

    @abstractmethod
    def sampler(self, params):
        """``sample(logits, previous_ids) -> int`` for backend logits of one row, as ``make_sampler(params)``."""

    def greedy_tokens(self, token: int):
        """Optional: an iterator over the greedy continuation of ``token`` (the argmax token after it, then the
        one after that, ...), each step's argmax fed to the next step on the device, so steps need not wait for the
        host. The runner may compute up to two steps ahead of what was consumed (cache positions past the last
        token yielded: the engine resets the cache before each generation). None: not offered (the engine calls
        ``step`` and ``sampler``). Used for temperature 0 without a repetition penalty."""
        return None


def _is_numpy(x) -> bool:
    return type(x).__module__ == "numpy"


def _host_of(x):
    to_host = getattr(x, "_lumen_to_host", None)
    if to_host is not None:
        return to_host()
    if hasattr(x, "get"):  # cupy
        return x.get()
    raise TypeError(f"cannot move a {type(x).__name__} across devices")


class OpSet:
    """``ops.<name>(...)`` resolved against the registry for one backend, with weight-format variants."""

    def __init__(self, backend: Backend):
        self._backend = backend

    def __getattr__(self, op: str):
        if op.startswith("_"):
            raise AttributeError(op)
        from .ops import COMPOSITES

        if op in COMPOSITES and not self.has(op):  # an optional op this backend leaves to the composite
            composite = COMPOSITES[op]

            def bound(*args, **kwargs):
                return composite(self, *args, **kwargs)

            setattr(self, op, bound)
            return bound
        bound = _BoundOp(self._backend, op)
        setattr(self, op, bound)  # later lookups are plain attribute reads (this is on the decode hot path)
        return bound

    def resolve(self, op: str, variant: str | None = None):
        return getattr(self, op).resolve(variant)

    def has(self, op: str) -> bool:
        return self._backend.registry.op(op, self._backend.name) is not None


class _BoundOp:
    __slots__ = ("backend", "op", "fns")

    def __init__(self, backend: Backend, op: str):
        self.backend, self.op, self.fns = backend, op, {}

    def resolve(self, variant: str | None):
        fn = self.fns.get(variant)
        if fn is None:
            fn = self.backend.registry.op(self.op, self.backend.name, variant)
            if fn is None:
                raise PlanError(
                    f"op {self.op!r} (variant {variant}) is not implemented by backend {self.backend.name!r}"
                )
            self.fns[variant] = fn
        return fn

    def __call__(self, *args, **kwargs):
        variant = None
        for a in args:
            if type(a) is Weight:
                variant = a.format
                break
        fn = self.fns.get(variant) or self.resolve(variant)
        return fn(*args, **kwargs)
