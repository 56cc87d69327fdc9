"""The plan: every component resolved to backend, device, store, weight format and bytes.

Built from the config, the checkpoint header and the architecture only: nothing is read or loaded, so a
config that cannot run is refused before the first weight moves.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from .architecture import Architecture, Component, component_label
from .config import Config, Placement
from .errors import CheckpointError, ConfigError, PlanError
from .tensors import SCALE_SUFFIXES, check_tensors, is_nvfp4

DTYPE_FORMAT = {"F32": "f32", "F16": "f16", "BF16": "bf16", "F8_E4M3": "fp8"}
KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "fp8": 1}
# What this version executes; the rest of the config layout is validated and refused by name.
UNSUPPORTED = {
    "audio tower": "Lumen has no audio tower (Gemma 4 E2B/E4B's audio encoder); remove the 'audio' block",
}
DRAFT_PREFIX = "draft."  # the draft model's plan rows, merged into the main plan


@dataclass
class PlanEntry:
    component: str
    backend: str
    device: str
    store: str
    format: str
    nbytes: int
    kind: str = "weights"  # "weights" or "cache"


@dataclass
class Plan:
    entries: list[PlanEntry] = field(default_factory=list)
    capacity: dict[str, int] = field(default_factory=dict)  # memory pool -> bytes available
    context_size: int = 0
    notes: list[str] = field(default_factory=list)  # config values that have no effect on this model
    devices: dict[str, str] = field(default_factory=dict)  # device -> what its backend says of it (GPU, driver)

    def pools(self) -> dict[str, int]:
        """Bytes per memory pool: 'host RAM', 'cuda:0 VRAM', 'mmap (page cache)'."""
        out: dict[str, int] = {}
        for e in self.entries:
            pool = memory_pool(e.device, e.store)
            out[pool] = out.get(pool, 0) + e.nbytes
        return out

    def pinned(self) -> int:
        """Bytes of the host-RAM pool that a GPU keeps page-locked (its routed experts with store 'ram')."""
        return sum(e.nbytes for e in self.entries if e.store == "ram" and e.device != "cpu")

    def to_json(self) -> str:
        return json.dumps(
            {
                "context_size": self.context_size,
                "entries": [asdict(e) for e in self.entries],
                "pools": self.pools(),
                "pinned": self.pinned(),
                "capacity": self.capacity,
                "notes": self.notes,
                "devices": self.devices,
            },
            indent=2,
        )


def memory_pool(device: str, store: str) -> str:
    if store == "mmap":
        return "mmap (page cache)"
    if store == "vram":
        return f"{device} VRAM"
    return "host RAM"


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel could give without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def weight_format(ckpt, name: str) -> str:
    info = ckpt.tensors[name]
    if info.dtype == "U8" and is_nvfp4(ckpt, name):
        return "nvfp4"
    return DTYPE_FORMAT.get(info.dtype, info.dtype.lower())


PLAIN_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def tensor_bytes(ckpt, arch: Architecture, name: str, backend_cls=None, store: str = "ram") -> int:
    """Bytes the tensor takes once loaded; ``backend_cls``: the backend it is loaded on with ``store``
    (``stored_format``, ``stored_nbytes``)."""
    info = ckpt.tensors[name]
    if not arch.is_matrix(name):
        return max(1, info.nbytes // _itemsize(info)) * 4  # small tensors are kept as f32
    if backend_cls is not None:
        fmt = weight_format(ckpt, name)
        own = backend_cls.stored_nbytes(fmt, tuple(info.shape), store)
        if own is not None:
            return own
        stored = backend_cls.stored_format(fmt, store)
        if stored != fmt:
            return math.prod(info.shape) * PLAIN_BYTES[stored]
    scales = (ckpt.tensors.get(name + s) for s in SCALE_SUFFIXES)
    return info.nbytes + sum(s.nbytes for s in scales if s is not None)


def _itemsize(info) -> int:
    n = 1
    for d in info.shape:
        n *= d
    return info.nbytes // max(n, 1) or 1


def check_features(config) -> None:
    for path, feature in config.requested_features():
        if feature in UNSUPPORTED:
            raise ConfigError(path, f"{feature}: not supported by this version of Lumen", UNSUPPORTED[feature])


def check_vision(config, arch: Architecture, ckpt) -> None:
    """A ``vision`` block loads the checkpoint's vision tower (``arch.vision``: the layout places its tensors in the
    component ``("vision", None)``); refused by name where the checkpoint or its architecture has none."""
    if "vision" not in config.raw:
        return
    if not arch.has_vision():
        what = "a GGUF file (its vision tower comes in a separate mmproj file, which Lumen does not read)" \
            if getattr(ckpt, "format", "") == "gguf" else f"a {arch.model_type} checkpoint without a vision tower"
        raise ConfigError("vision", f"{ckpt.path} is {what}: there is no vision tower to load",
                          "remove the 'vision' block, or point model.path at a multimodal checkpoint")
    arch.vision = True
    arch.check_checkpoint(ckpt)  # again, with the tower's tensors: wrong shapes are refused before any weight loads


VISION_SCORES_BOUND = 1 << 30  # a tower's attention scores are computed in blocks of at most this (cuda; cpu: less)


def _vision_activations(arch: Architecture, ckpt, registry, place, plan: Plan) -> None:
    """A plan row for the vision tower's working memory on its largest image: per patch its hidden state, q/k/v and
    MLP activations in f32 (4 x hidden + intermediate), plus one block of attention scores (heads x patches^2,
    computed in blocks of at most ``VISION_SCORES_BOUND``). An estimate, said so; none where the family does not
    say its largest image."""
    reader = getattr(ckpt, "preprocessor_config", None)
    processor = arch.image_processor(reader() if reader is not None else None)
    patches = getattr(processor, "max_patches", None)
    vc = arch.config.get("vision_config") or {}
    hidden, inter = vc.get("hidden_size"), vc.get("intermediate_size")
    heads = vc.get("num_attention_heads", vc.get("num_heads"))
    if not all(isinstance(v, int) and v > 0 for v in (patches, hidden, inter, heads)):
        return
    nbytes = patches * (4 * hidden + inter) * 4 + min(heads * patches * patches * 4, VISION_SCORES_BOUND)
    store = "vram" if "vram" in registry.backend_class(place.backend).stores else "ram"
    plan.entries.append(PlanEntry(f"vision activations (largest image: {patches} patches, estimate)", place.backend,
                                  place.device, store, "f32", nbytes, kind="cache"))


def check_fp8_attention(config, placements: dict, registry) -> None:
    """LumenLLM's ``attention.compute-quantization: fp8`` (attention computed in FP8 MMA; the fp8 KV cache it needs
    is checked by the config) runs where the backend has it (``Backend.attention_quantizations``): refused naming the
    backends that compute a layer's token mixer (``mixer_components``) and have not."""
    if ("model.attention.compute-quantization", "fp8 attention") not in config.requested_features():
        return
    backends = sorted({placements[comp].backend for comp in mixer_components(placements)})
    lacking = [b for b in backends if "fp8" not in _attention_quantizations(registry, b)]
    if lacking:
        having = [b for b in sorted(registry.backends) if "fp8" in _attention_quantizations(registry, b)]
        where = f"compute the attention on {' or '.join(having)}, or " if having else ""
        raise ConfigError("model.attention.compute-quantization",
                          f"fp8 attention (attention computed in FP8 E4M3 MMA) is not implemented by backend "
                          f"{', '.join(repr(b) for b in lacking)}, which computes this model's attention: it reads "
                          "the fp8 KV cache and computes in f32",
                          f'{where}set compute-quantization to "default" (the fp8 KV cache still halves the cache '
                          "memory)")


def mixer_components(components) -> list:
    """Per layer, the component that computes its token mixer: ``("attention", i)`` where the config places the
    mixer apart from the layer (``split_mixers``), else ``("layer", i)``."""
    split = {c[1] for c in components if c[0] == "attention"}
    return [c for c in components if c[0] == "attention" or (c[0] == "layer" and c[1] not in split)]


def _attention_quantizations(registry, backend: str) -> tuple[str, ...]:
    try:
        return registry.backend_class(backend).attention_quantizations
    except Exception:  # an installed backend that cannot be imported here (e.g. no CuPy) names nothing
        return ()


def check_placement(config, arch: Architecture, registry, components: list[Component],
                    notes: list[str] | None = None) -> dict:
    """Resolve and check each component's placement; return {component: Placement}. A note for each block whose
    store was read in LumenLLM's meaning (mmap under a GPU: ram) goes to `notes`."""
    placements, checked, mmap_as_ram = {}, set(), {}
    for comp in components:
        p = config.placement(*comp)
        path = config.placement_path(*comp)
        if p.compute not in checked:
            _check_device(registry, p, path)
            checked.add(p.compute)
        cls = registry.backend_class(p.backend)
        only_experts = tuple(s for s in cls.expert_stores if s not in cls.stores)
        allowed = cls.stores + (only_experts if comp[0] == "experts" else ())
        if p.store == "mmap" and "mmap" not in allowed and "ram" in allowed and p.backend != "cpu":
            # LumenLLM: "mmap currently behaves like ram on the CUDA backend (both pin a host arena)". Its meaning
            # wins: a GPU reads these weights from page-locked host RAM, as with store ram.
            p = Placement(p.compute, "ram")
            mmap_as_ram.setdefault(path, []).append(component_label(comp))
        if p.store not in allowed:
            extra = (f" (and {', '.join(only_experts)} for the routed experts)"
                     if only_experts and comp[0] != "experts" else "")
            raise ConfigError(
                path, f"backend {p.backend!r} cannot compute from store {p.store!r}{extra}",
                f"use one of: {', '.join(allowed)}",
            )
        missing = arch.required_ops(comp) - registry.ops_of(p.backend)
        if missing:
            raise ConfigError(
                path, f"backend {p.backend!r} lacks ops {sorted(missing)} needed by {component_label(comp)}",
                "place this component on a backend that implements them",
            )
        if comp[0] == "layer" and ("attention", comp[1]) not in components or comp[0] in ("attention", "mtp"):
            _check_kv_types(config, cls)  # the KV cache lives with the token mixer (the MTP head's: with it)
            _check_kv_store(config, cls, comp)
        if comp[0] == "attention" and p.compute != placements[("layer", comp[1])].compute \
                and not arch.mixer_compute_apart:
            raise ConfigError(path, f"the {arch.model_type} architecture cannot compute a layer's attention on another "
                                    f"device than the rest of the layer yet ({component_label(comp)} on {p.compute}, "
                                    f"layers.{comp[1]} on {placements[('layer', comp[1])].compute})",
                              f"remove attention.compute (attention computes with its layer), or set it to "
                              f"{placements[('layer', comp[1])].compute}")
        placements[comp] = p
    if notes is not None:
        for path, labels in mmap_as_ram.items():
            shown = ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")
            notes.append(f"{path}: store mmap under a GPU compute device is read as ram, as in LumenLLM (page-locked "
                         f"host memory the GPU reads over PCIe; a GPU cannot compute from a file mapping): {shown}")
    return placements


def _check_kv_types(config, backend_cls) -> None:
    kv = config.kv_cache()
    supported = backend_cls.kv_types
    for key, value in (("type-k", kv.type_k), ("type-v", kv.type_v)):
        if value not in supported:
            raise ConfigError(
                f"model.hidden-layers.kv-cache.{key}",
                f"backend {backend_cls.name!r} cannot keep a {value} KV cache",
                f"use one of: {', '.join(supported)}",
            )


def _check_kv_store(config, backend_cls, comp) -> None:
    """``kv-cache.store`` must be a memory the layer's backend keeps caches in (the CPU: ram; cuda: vram)."""
    store = config.kv_cache().store
    if store is not None and store not in backend_cls.kv_stores:
        raise ConfigError(
            "model.hidden-layers.kv-cache.store",
            f"{component_label(comp)} computes on backend {backend_cls.name!r}, which keeps its KV cache in "
            f"{' or '.join(backend_cls.kv_stores)}; a KV cache in {store!r} there is not supported yet",
            f"remove kv-cache.store, or set it to {backend_cls.kv_stores[0]!r}",
        )


def _check_device(registry, p, path: str) -> None:
    from .errors import PluginError

    try:
        cls = registry.backend_class(p.backend)
    except PluginError as exc:
        raise ConfigError(path, str(exc)) from None
    try:
        cls.device_info(p.device)
    except PlanError as exc:
        # a backend that knows why (CuPy missing, no driver) puts its own fix on the error
        raise ConfigError(path, str(exc), getattr(exc, "fix", 'pick a device that exists, e.g. "cpu"')) from None


def make_plan(config, arch: Architecture, ckpt, registry) -> tuple[Plan, dict]:
    """Resolve placement, size every component and cache, and refuse a plan that does not fit. With a draft model
    (``draft``) the draft is planned too, at the main model's context size, its rows and notes merged in (labels
    ``draft.…``, notes ``draft: …``) and both models counted against the memory; ``resolved["draft_config"]`` is
    the draft's Config with that context size (None without a draft model). With ``draft.mtp`` the checkpoint's
    multi-token-prediction head is planned as the component ``mtp`` (the output layer's placement)."""
    plan, resolved = plan_model(config, arch, ckpt, registry)
    spec = config.draft()
    resolved["draft_config"] = None
    placements = list(resolved["placements"].values())
    if spec is not None:
        check_speculative(registry, resolved["placements"], "the main model")
        if spec.config is not None:
            draft_plan, draft_resolved, draft_config = plan_draft(config, spec.config, plan.context_size, registry)
            check_speculative(registry, draft_resolved["placements"], "the draft model")
            plan.notes.append(f"speculative decoding: the draft model {draft_config.model_path} proposes "
                              f"{spec.tokens} token(s) per verification step")
            merge_draft(plan, draft_plan)
            placements += draft_resolved["placements"].values()
            resolved["draft_config"] = draft_config
        else:
            plan.notes.append(f"speculative decoding: the checkpoint's multi-token-prediction head ({arch.mtp_layers} "
                              f"layer(s)) proposes {spec.tokens} token(s) per verification step")
    _fit(plan, registry, placements)
    return plan, resolved


def plan_model(config, arch: Architecture, ckpt, registry) -> tuple[Plan, dict]:
    """One model's plan (its rows, notes and resolved placement), not yet held against the memory (``_fit``)."""
    check_features(config)
    config.check_ranges(arch.num_layers)
    check_mtp(config, arch, ckpt)
    check_vision(config, arch, ckpt)
    layout = arch.layout(ckpt.tensors)
    if arch.use_mtp and ("mtp", None) not in layout.needs:
        raise PlanError(f"the {arch.model_type} architecture says {ckpt.path} has {arch.mtp_layers} multi-token-"
                        "prediction layer(s) but puts none of its tensors in the ('mtp', None) component: the "
                        "model plugin cannot load its MTP head; use a draft model instead (draft.path)")
    report = check_tensors(ckpt, layout)
    split_mixers(config, arch, layout)
    components = []
    for c in arch.components():
        if c in layout.needs or c[0] == "layer":
            components.append(c)
        if c[0] == "layer" and ("attention", c[1]) in layout.needs:
            components.append(("attention", c[1]))
    placement_notes: list[str] = []
    placements = check_placement(config, arch, registry, components, placement_notes)
    check_fp8_attention(config, placements, registry)
    kv = config.kv_cache()
    context_notes = check_context(kv, arch, ckpt)
    context = kv.context_size or arch.max_context
    kv_bytes = (KV_BYTES[kv.type_k] + KV_BYTES[kv.type_v]) / 2
    kv_fmt = kv.type_k if kv.type_k == kv.type_v else f"{kv.type_k}/{kv.type_v}"
    plan = Plan(context_size=context)
    placed: set[tuple[str, str, str]] = set()  # (tensor, device, store): a tied tensor is held once per place
    converted: dict[str, dict[str, str]] = {}  # device -> {checkpoint format: what its backend converts it to}
    why_converted: dict[str, str] = {}  # device -> its backend's reason (Backend.conversion_reason)
    for comp in components:
        p = placements[comp]
        names = layout.needs.get(comp, [])
        cls = registry.backend_class(p.backend)
        given = {weight_format(ckpt, n) for n in names if arch.is_matrix(n)}
        fmts = sorted({cls.stored_format(f, p.store) for f in given}) or ["f32"]
        converted.setdefault(p.device, {}).update({f: cls.stored_format(f, p.store) for f in given
                                                   if cls.stored_format(f, p.store) != f})
        why_converted[p.device] = cls.conversion_reason
        fresh = [n for n in names if (n, p.device, p.store) not in placed]
        placed.update((n, p.device, p.store) for n in names)
        nbytes = sum(tensor_bytes(ckpt, arch, n, cls, p.store) for n in fresh)
        plan.entries.append(
            PlanEntry(component_label(comp), p.backend, p.device, p.store, "+".join(fmts), nbytes)
        )
        # a layer's KV cache (or recurrent state) lives with its token mixer: after the mixer's row when it has one;
        # the MTP head's with the head (on the output layer's device)
        if comp[0] == "layer" and ("attention", comp[1]) not in placements or comp[0] in ("attention", "mtp"):
            one = (arch.mtp_cache_bytes(context, kv_bytes) if comp[0] == "mtp"
                   else arch.cache_bytes(comp[1], context, kv_bytes))
            label = "cache.mtp" if comp[0] == "mtp" else f"cache.layers.{comp[1]}"
            # one cache per generation held at once; the MTP head's: one (only a generation that runs alone drafts:
            # batched generations do not)
            held = 1 if comp[0] == "mtp" else kv.sequences
            plan.entries.append(
                PlanEntry(label, p.backend, p.device, kv.store or kv_home(cls, p.store), kv_fmt, one * held,
                          kind="cache")
            )
    if ("vision", None) in placements:
        _vision_activations(arch, ckpt, registry, placements[("vision", None)], plan)
    for device, fmts in sorted(converted.items()):
        if fmts:
            pairs = ", ".join(f"{f} -> {to}" for f, to in sorted(fmts.items()))
            placement_notes.append(f"{device}: weights converted on load ({pairs}): {why_converted[device]}; the plan "
                                   "counts the converted bytes")
    if kv.prefix_cache_mb:  # snapshots of earlier prompts' caches, in host RAM (lumen_core.prefix_cache)
        lacking = sorted({p.backend for p in placements.values()
                          if not registry.backend_class(p.backend).prefix_cache})
        if lacking:
            err = PlanError(f"kv-cache.prefix-cache-mb is {kv.prefix_cache_mb:g} but the prefix cache cannot save the "
                            f"caches of the {', '.join(lacking)} backend yet")
            err.fix = "remove kv-cache.prefix-cache-mb (or --prefix-cache-mb), or place the layers on cpu / cuda:N"
            raise err
        plan.entries.append(PlanEntry("prefix cache", "cpu", "cpu", "ram", "-", int(kv.prefix_cache_mb * 1e6),
                                      kind="cache"))
    if config.attention_compute_quantization() == "fp8":
        context_notes.append("attention.compute-quantization fp8: prompts' attention runs in FP8 (e4m3) MMA over the "
                             "fp8 KV cache; one token at a time (decode) reads the same cache in f32 arithmetic")
    if kv.sequences > 1:
        context_notes.append(f"kv-cache.sequences {kv.sequences}: every cache row counts {kv.sequences} caches of "
                             f"{context} tokens (one per generation held at once: the server's batch)")
    plan.notes = (config.range_notes(arch.num_layers) + placement_notes + context_notes
                  + _no_effect_notes(config, components)
                  + _expert_cache(config, arch, registry, placements, plan))
    return plan, {"placements": placements, "layout": layout, "kv": kv, "report": report}


# ---------------------------------------------------------------- speculative decoding (draft model, MTP head)


def check_mtp(config, arch: Architecture, ckpt) -> None:
    """``draft.mtp``: draft with the checkpoint's multi-token-prediction head. Refused where the checkpoint has
    none (``arch.mtp_layers`` 0); else ``arch.use_mtp`` is set, so the layout puts the head's tensors in the
    component ``("mtp", None)``, and the checkpoint is checked again with them (shapes, before any weight loads)."""
    spec = config.draft()
    if spec is None or not spec.mtp:
        return
    if not arch.mtp_layers:
        err = PlanError(f"draft.mtp: {ckpt.path} has no multi-token-prediction head (no mtp.* tensors / "
                        "mtp_num_hidden_layers 0); use a draft model instead (draft.path, or --draft-model PATH)")
        err.fix = "remove draft.mtp (or --mtp) and name a draft model: draft.path or --draft-model PATH"
        raise err
    arch.use_mtp = True
    arch.check_checkpoint(ckpt)


def check_speculative(registry, placements: dict, who: str) -> None:
    """Speculative decoding copies and rewinds every cache (a rejected draft token is taken back): refused, naming
    the backend and the components, where one of ``who``'s components sits on a backend that cannot
    (``Backend.speculative`` False)."""
    lacking: dict[str, list[str]] = {}
    for comp, p in placements.items():
        if not registry.backend_class(p.backend).speculative:
            lacking.setdefault(p.backend, []).append(component_label(comp))
    if not lacking:
        return
    backend, labels = next(iter(sorted(lacking.items())))
    shown = ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")
    fix = (f"place {who} on cpu or cuda:N (draft.model's compute/store, or draft.compute/store), or remove the draft"
           if who == "the draft model" else
           f"place {who} on cpu or cuda:N, or remove the draft block (and --draft-model / --mtp)")
    err = PlanError(f"speculative decoding cannot run on backend {backend!r} yet: its caches cannot be copied or "
                    f"rewound to an earlier position after a rejected draft token, and {who} computes {shown} there; "
                    f"fix: {fix}")
    err.fix = fix
    raise err


def plan_draft(config, draft: Config, context: int, registry) -> tuple[Plan, dict, Config]:
    """The draft model's plan at the main model's ``context`` (one sequence), from its own checkpoint and the
    architecture the registry has for it; returns it with its resolved placement and the draft's Config as planned
    (what ``Engine.load`` of the draft plans again, exactly). Errors say they are about the draft: a ConfigError's
    path is under ``draft.`` (the draft's model block is read as ``draft.model``)."""
    from .checkpoint import open_checkpoint

    with _about_the_draft():
        ckpt = open_checkpoint(draft.model_path, registry)
        arch = registry.architecture_class(ckpt.config.get("model_type", "<missing>")).from_checkpoint(ckpt)
    fixed, notes = draft_at_context(config, draft, arch, ckpt, context)  # its refusal names the main context key
    with _about_the_draft():
        plan, resolved = plan_model(fixed, arch, ckpt, registry)
    plan.notes = notes + plan.notes
    return plan, resolved, fixed


@contextmanager
def _about_the_draft():
    """Errors raised while the draft model is opened or planned, said to be about it: ``the draft model: …``, a
    ConfigError's path under ``draft.`` (the draft's model block is ``draft.model``)."""
    try:
        yield
    except ConfigError as exc:
        path = DRAFT_PREFIX + exc.path if exc.path.startswith("model") else exc.path
        raise ConfigError(path, f"the draft model: {exc.message}", exc.fix) from None
    except CheckpointError as exc:
        raise CheckpointError(f"the draft model: {str(exc).replace('model.path', 'draft.model.path')}") from None
    except PlanError as exc:
        err = PlanError(f"the draft model: {exc}")
        err.fix = getattr(exc, "fix", None)
        raise err from None


def draft_at_context(config, draft: Config, arch: Architecture, ckpt, context: int) -> tuple[Config, list[str]]:
    """The draft's Config holding the main model's ``context`` tokens (it drafts after every token the main model
    holds) and one sequence (only a generation that runs alone drafts: batched ones do not), and notes. A draft
    trained on fewer tokens than ``context`` is refused unless allow-beyond-trained-context (the main model's or
    the draft's own) says that is the user's call."""
    main_kv, own_kv = config.kv_cache(), draft.kv_cache()
    trained = arch.max_context
    beyond = bool(trained and context > trained)
    if beyond and not (main_kv.allow_beyond_trained_context or own_kv.allow_beyond_trained_context):
        source = "GGUF context_length" if getattr(ckpt, "format", "") == "gguf" else "max_position_embeddings"
        raise ConfigError(
            CONTEXT_PATH,
            f"the main model's context of {context} tokens is beyond the draft model's trained context of {trained} "
            f"tokens ({source} of {ckpt.path}): the draft must hold as many tokens as the main model",
            f"set {CONTEXT_PATH} to at most {trained}, or pick a draft trained on at least {context} tokens; or, if "
            f"you handle RoPE scaling yourself, set {BEYOND_PATH}: true",
        )
    notes = []
    if own_kv.context_size is not None and own_kv.context_size != context:
        notes.append(f"config draft.model.hidden-layers.kv-cache.context-size {own_kv.context_size} is not used: the "
                     f"draft holds the main model's context of {context} tokens (as many as the main model)")
    raw = copy.deepcopy(draft.raw)
    kv = raw["model"].setdefault("hidden-layers", {}).setdefault("kv-cache", {})
    kv["sequences"] = 1
    if context:
        kv["context-size"] = context
    if beyond:
        kv["allow-beyond-trained-context"] = True
    return Config(raw, draft.source, draft.base_dir), notes


def merge_draft(plan: Plan, draft: Plan) -> None:
    """The draft's rows and notes into the main plan: labels prefixed ``draft.``, notes ``draft: ``."""
    plan.entries += [PlanEntry(**{**asdict(e), "component": DRAFT_PREFIX + e.component}) for e in draft.entries]
    plan.notes += [f"draft: {n}" for n in draft.notes]


def split_mixers(config, arch: Architecture, layout) -> None:
    """LumenLLM's ``model.attention`` block: where it places a layer's token mixer (attention or Gated-DeltaNet)
    apart from the rest of the layer, those tensors become the component ``("attention", i)`` (its own store, so its
    own plan row and memory pool); the loader folds them back into the layer's weights (``load_weights``)."""
    for (block, i), names in list(layout.needs.items()):
        if block != "layer" or config.placement("attention", i) == config.placement("layer", i):
            continue
        mixer = [n for n in names if arch.is_mixer(n)]
        if mixer:
            layout.needs[("layer", i)] = [n for n in names if not arch.is_mixer(n)]
            layout.needs[("attention", i)] = mixer


CONTEXT_PATH = "model.hidden-layers.kv-cache.context-size"
BEYOND_PATH = "model.hidden-layers.kv-cache.allow-beyond-trained-context"


def check_context(kv, arch: Architecture, ckpt) -> list[str]:
    """Refuse a context-size past the model's trained context (positions it never saw: without RoPE scaling the
    output degrades), unless allow-beyond-trained-context says that is the user's call; return notes."""
    trained = arch.max_context
    source = "GGUF context_length" if getattr(ckpt, "format", "") == "gguf" else "max_position_embeddings"
    size, allowed = kv.context_size, kv.allow_beyond_trained_context
    beyond = bool(size and trained and size > trained)
    if beyond and not allowed:
        raise ConfigError(
            CONTEXT_PATH,
            f"context-size {size} is beyond the model's trained context of {trained} tokens ({source} of "
            f"{ckpt.path})",
            f"set it to at most {trained}; or, if you handle RoPE scaling yourself, set {BEYOND_PATH}: true",
        )
    if beyond:
        return [f"config {CONTEXT_PATH}: {size} tokens is beyond the trained context of {trained} ({source}); "
                f"allowed by {BEYOND_PATH}: positions past {trained} are your responsibility (Lumen uses the "
                "checkpoint's RoPE settings as they are)"]
    if allowed and not trained:
        return [f"config {BEYOND_PATH}: the checkpoint does not say its trained context, so this key has no effect"]
    if allowed:
        return [f"config {BEYOND_PATH}: context-size {size or trained} is within the trained context of {trained} "
                "tokens, so this key has no effect"]
    return []


def kv_home(backend_cls, store: str) -> str:
    """Where a layer's KV cache lives when kv-cache.store is omitted: the memory its weights are in (mmap: RAM), where
    its backend keeps caches there, else the backend's own (a GPU layer whose weights stay in host RAM: VRAM)."""
    store = "ram" if store == "mmap" else store
    return store if store in backend_cls.kv_stores else backend_cls.kv_stores[0]


DEFAULT_EXPERT_CACHE = 32  # experts kept in VRAM per GPU when streamed (lumen_cuda.stream uses it too)


def _expert_cache(config, arch: Architecture, registry, placements: dict, plan: Plan) -> list[str]:
    """The VRAM expert cache of each GPU that computes routed experts from a host store (a plan entry of its
    bytes: slots x the largest expert), and notes where the configured cache has no effect."""
    for i, r in enumerate(config.ranges()):
        if "cache" in r.get("experts", {}):
            raise ConfigError(f"model.hidden-layers.ranges[{i}].experts.cache",
                              "the expert cache is per GPU, not per range",
                              "set it once, in model.hidden-layers.experts.cache")
    slots = config.expert_cache() or DEFAULT_EXPERT_CACHE
    n_experts = getattr(getattr(arch, "args", None), "num_experts", None) or 0
    per_device: dict[tuple[str, str], tuple[int, str]] = {}
    for comp, p in placements.items():
        if comp[0] != "experts" or p.store not in registry.backend_class(p.backend).expert_stores:
            continue
        entry = next(e for e in plan.entries if e.component == component_label(comp))
        one = entry.nbytes // max(n_experts, 1)
        size, fmt = per_device.get((p.backend, p.device), (0, entry.format))
        per_device[(p.backend, p.device)] = (max(size, one), fmt)
    for (backend, device), (one, fmt) in sorted(per_device.items()):
        plan.entries.append(PlanEntry(f"expert cache ({slots} experts)", backend, device, "vram", fmt, slots * one,
                                      kind="cache"))
    if config.expert_cache() is not None and not per_device:
        return ["config model.hidden-layers.experts.cache: no routed experts are streamed from host memory to a "
                "GPU (experts.store ram with a GPU compute), so the cache has no effect"]
    return []


def _no_effect_notes(config, components: list[Component]) -> list[str]:
    """Placement the user wrote that this model cannot use: said out loud, never silently ignored."""
    if any(block == "experts" for block, _ in components):
        return []
    hidden = config.raw.get("model", {}).get("hidden-layers", {})
    paths = ["model.hidden-layers.experts"] if "experts" in hidden else []
    paths += [f"model.hidden-layers.ranges[{i}].experts" for i, r in enumerate(hidden.get("ranges", []))
              if "experts" in r]
    return [f"config {p}: this model has no routed experts, so this placement has no effect" for p in paths]


def _capacity(registry, placements: Iterable[Placement], devices: dict[str, str] | None = None) -> dict[str, int]:
    """Bytes available per memory pool. A device whose backend cannot tell its memory (WebGPU reports no VRAM
    size: total_bytes 0) has no entry, so its pool is shown but not checked. ``devices`` gets each device's
    description."""
    cap = {"host RAM": host_available_bytes()}
    gpus = {(p.backend, p.device) for p in placements if p.backend != "cpu"}
    for backend, device in sorted(gpus):  # once per device, not once per component placed there
        info = registry.backend_class(backend).device_info(device)
        if devices is not None and info.description:
            devices[device] = info.description
        if info.total_bytes:
            cap[f"{device} VRAM"] = info.free_bytes
    return cap


def _fit(plan: Plan, registry, placements: Iterable[Placement]) -> None:
    """Every pool's bytes (the main model's and a draft's) against what is available; a PlanError where one is
    short, naming the largest rows there and what to move."""
    plan.capacity = _capacity(registry, placements, plan.devices)
    for pool, need in plan.pools().items():
        have = plan.capacity.get(pool)
        if have is not None and need > have:
            biggest = sorted((e for e in plan.entries if memory_pool(e.device, e.store) == pool),
                             key=lambda e: -e.nbytes)[:3]
            names = ", ".join(f"{e.component} ({gib(e.nbytes)})" for e in biggest)
            raise PlanError(
                f"the plan does not fit: {pool} needs {gib(need)} but {gib(have)} is available. "
                f"Largest there: {names}. {fit_advice(pool, plan.entries)}"
            )


def fit_advice(pool: str, entries: list[PlanEntry]) -> str:
    """What to move out of an overfull memory pool, in the config's words."""
    mine = [e for e in entries if memory_pool(e.device, e.store) == pool]
    experts = sum(e.nbytes for e in mine if e.component.endswith(".experts"))
    wide_kv = sum(e.nbytes for e in mine
                  if e.component.removeprefix(DRAFT_PREFIX).startswith("cache.") and e.format != "fp8")
    drafted = sum(e.nbytes for e in mine if e.component.startswith(DRAFT_PREFIX))
    draft_tip = ([f"the draft model ({gib(drafted)} here) can go elsewhere (draft.model's compute/store) or be "
                  "smaller, or draft with the checkpoint's MTP head (draft.mtp)"] if drafted else [])
    kv_tip = ("or lower hidden-layers.kv-cache.context-size (or kv-cache.sequences)" if not wide_kv else
              "or lower hidden-layers.kv-cache.context-size (or kv-cache.sequences), or make the KV cache "
              f"({gib(wide_kv)} here) fp8 with "
              "hidden-layers.kv-cache: {type-k: fp8, type-v: fp8} (1 byte an element: half of bf16)")
    if pool.endswith(" VRAM"):
        device = pool.removesuffix(" VRAM")
        tips = []
        if experts:
            tips.append(f"the routed experts ({gib(experts)} here) can stay in host RAM: stream them with "
                        f"hidden-layers.experts: {{compute: {device}, store: ram}} or compute them on the CPU with "
                        "hidden-layers.experts: {compute: cpu, store: mmap}")
        tips.append("a range of layers can go to another GPU or the CPU (hidden-layers.ranges)")
        tips += draft_tip
        tips.append(kv_tip)
        return "Fixes: " + "; ".join(tips)
    return ("Fixes: store: mmap keeps weights in the file's page cache instead of private RAM; "
            + "".join(t + "; " for t in draft_tip) + kv_tip)


def gib(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def format_plan(plan: Plan) -> str:
    rows = [("component", "backend", "device", "store", "format", "bytes")]
    rows += [(e.component, e.backend, e.device, e.store, e.format, gib(e.nbytes)) for e in plan.entries]
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(f"context size: {plan.context_size} tokens")
    lines += [f"note: {n}" for n in plan.notes]
    lines += [f"device {d}: {text}" for d, text in sorted(plan.devices.items())]
    for pool, need in sorted(plan.pools().items()):
        have = plan.capacity.get(pool)
        avail = (f" of {gib(have)} available" if have is not None else " (the device does not report its memory: "
                 "not checked)" if pool.endswith(" VRAM") else " (file-backed, not reserved)")
        pinned = plan.pinned() if pool == "host RAM" else 0
        lines.append(f"total {pool}: {gib(need)}{avail}"
                     + (f" (of which {gib(pinned)} page-locked for GPU streaming)" if pinned else ""))
    return "\n".join(lines)
