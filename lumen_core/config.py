"""The Lumen config: load, validate (schema + structural checks) and answer placement questions.

Placement follows one rule, documented in docs/config.md: a block's omitted `compute`/`store` come from
its parent, up to `model`, whose own defaults are `cpu` and `ram`. Nothing here looks at a checkpoint or
a device; the plan does that later with the numbers.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema import validators
from jsonschema.exceptions import ValidationError, best_match

from lumen_core.errors import ConfigError, InputError

DEFAULT_COMPUTE = "cpu"
DEFAULT_STORE = "ram"
DEFAULT_KV_TYPE = "f32"
COMPONENTS = ("input-layer", "output-layer", "layer", "attention", "experts", "vision")
HOST_STORES = ("ram", "mmap")
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string",
               list: "array", dict: "object", type(None): "null"}
_SAMPLING_NAMES = {"temperature": "temperature", "top-k": "top_k", "top-p": "top_p", "min-p": "min_p",
                   "seed": "seed", "max-tokens": "max_tokens", "stop": "stop",
                   "repetition-penalty": "repetition_penalty"}
_SERVER_NAMES = {"host": "host", "port": "port", "api-keys": "api_keys", "max-queue": "max_queue",
                 "request-timeout": "request_timeout", "max-body-bytes": "max_body_bytes",
                 "max-tokens-limit": "max_tokens", "server-api": "server_api", "fetch-timeout": "fetch_timeout",
                 "fetch-max-bytes": "fetch_max_bytes", "max-images": "max_images", "fetch-image-urls": "fetch_urls",
                 "scale-out": "scale_out"}
# The deepest value the schema allows is 7 levels down (draft.model.hidden-layers.ranges[0].experts.compute);
# anything much deeper is a mistake, refused by path before a recursive reader or printer could overflow.
MAX_DEPTH = 32
_PATH_KEYS = ("path", "chat-template")  # strings that name files: a NUL in them would crash open()


# ---------------------------------------------------------------- schema


def _schema_path() -> Path:
    # An installed wheel carries the schema inside the package (force-include); a checkout has it at the root.
    inside = Path(__file__).parent / "schemas" / "config.schema.json"
    return inside if inside.exists() else Path(__file__).parent.parent / "schemas" / "config.schema.json"


@cache
def _cached_schema() -> dict:
    return json.loads(_schema_path().read_text(encoding="utf-8"))


def schema() -> dict:
    """The JSON Schema of the config (a copy: callers may mutate it)."""
    return copy.deepcopy(_cached_schema())


def _is_integer(checker, instance) -> bool:
    # jsonschema counts 5.0 as an integer (JSON Schema: "a number with a zero fractional part"); the engine needs
    # a Python int (range(), array shapes), so an integer key takes only a JSON number written without a fraction
    # or exponent.
    return isinstance(instance, int) and not isinstance(instance, bool)


def _ecma_regex(pattern: str) -> str:
    # JSON Schema patterns are ECMA-262 regexes, where `$` (no multiline flag) matches only at the end of the
    # string; Python's `$` also matches before a final newline, which let "cpu\n" pass as a compute device.
    # `\Z` is ECMA's `$` in Python. Only a final, unescaped `$` is translated (the only place the schema uses it).
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        return pattern[:-1] + "\\Z"
    return pattern


def _pattern(validator, pattern: str, instance, schema):
    if validator.is_type(instance, "string") and not re.search(_ecma_regex(pattern), instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = validators.extend(
    jsonschema.Draft202012Validator,
    validators={"pattern": _pattern},
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer),
)


@cache
def _validator() -> jsonschema.Draft202012Validator:
    return _Validator(_cached_schema())


# ---------------------------------------------------------------- JSON paths


def json_path(parts) -> str:
    """`['model', 'hidden-layers', 'ranges', 0, 'start']` -> `model.hidden-layers.ranges[0].start`."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ---------------------------------------------------------------- reading


def _reject_constant(name: str):
    # json accepts NaN/Infinity, which would slip past every numeric bound in the schema.
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicates(pairs: list) -> dict:
    # json keeps the last of two equal keys silently; two `store`s in one block is a mistake worth naming.
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError("", f"duplicate key '{key}' in one object", "keep one of the two")
        seen[key] = value
    return seen


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"file not found: {path}", "check the path of the config file") from None
    except IsADirectoryError:
        raise ConfigError("", f"not a file: {path}",
                          "pass a JSON config file (a checkpoint dir goes to --model)") from None
    except UnicodeDecodeError as e:
        raise ConfigError("", f"cannot read {path}: {e}", "save the config as UTF-8 JSON") from None
    except OSError as e:  # permissions, a name too long, a broken device
        raise ConfigError("", f"cannot read {path}: {e.strerror or e}", "check the path and its permissions") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ConfigError("", f"invalid JSON in {path} at line {e.lineno}, column {e.colno}: {e.msg}",
                          "fix the JSON syntax (no trailing commas or comments)") from None
    except ValueError as e:  # NaN/Infinity, an integer of more than 4300 digits
        raise ConfigError("", f"cannot read {path}: {e}", "save the config as UTF-8 JSON") from None
    except RecursionError:
        raise ConfigError("", f"cannot read {path}: its arrays/objects are nested too deep for the JSON reader",
                          f"a config is at most {MAX_DEPTH} levels deep; see docs/config.md for the layout") from None


def _check_values(raw: Any) -> None:
    """What the schema cannot say, checked over the whole tree without recursion (so a value nested thousands
    deep is refused, not a RecursionError): depth, non-finite numbers (1e999 reads as inf), keys that are not
    strings (a dict given in code), lone surrogates (unprintable), NUL in a file name."""
    stack: list[tuple[Any, list]] = [(raw, [])]
    while stack:
        value, parts = stack.pop()
        if len(parts) > MAX_DEPTH:
            raise ConfigError(json_path(parts[:MAX_DEPTH + 1]), f"nested more than {MAX_DEPTH} levels deep",
                              "remove the nesting: no config key is more than 7 levels deep (docs/config.md)")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ConfigError(json_path(parts), f"key {key!r} is not a string", "write keys as strings")
                _check_text(key, parts, "a key")
                stack.append((item, parts + [key]))
        elif isinstance(value, list | tuple):
            stack.extend((item, parts + [i]) for i, item in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(json_path(parts), f"{value} is not a finite number (JSON has no NaN or Infinity; "
                              "a literal like 1e999 overflows to infinity)", "write a finite number")
        elif isinstance(value, str):
            _check_text(value, parts, "the value")
            if parts and parts[-1] in _PATH_KEYS and "\0" in value:
                raise ConfigError(json_path(parts), "a file name cannot contain a NUL character (\\u0000)",
                                  "remove it from the path")


def _check_text(text: str, parts: list, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(json_path(parts), f"{what} {_show(text)} holds a lone UTF-16 surrogate, which is not "
                          "text", "write the character itself, or a surrogate pair") from None


# ---------------------------------------------------------------- schema errors, in words


def _type_name(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _unknown_key(error: ValidationError) -> ConfigError:
    allowed = sorted(error.schema.get("properties", {}))
    extra = [k for k in error.instance if k not in allowed]
    message = f"unknown key '{extra[0]}'; allowed keys: {', '.join(allowed)}"
    if len(extra) > 1:
        message += f" (also unknown: {', '.join(repr(k) for k in extra[1:])})"
    close = difflib.get_close_matches(extra[0], allowed, n=1)
    fix = f"did you mean '{close[0]}'?" if close else "remove the key or move it to the block it belongs to"
    return ConfigError(_join(json_path(error.absolute_path), extra[0]), message, fix)


def _missing_key(error: ValidationError) -> ConfigError:
    missing = next(k for k in error.validator_value if k not in error.instance)
    return ConfigError(_join(json_path(error.absolute_path), missing),
                       f"missing required key '{missing}'", f"add '{missing}'")


def _show(value: Any, limit: int = 60) -> str:
    # A whole block given where a string belongs would flood the message; its start is enough.
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):  # a dict given in code may hold what JSON cannot write
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _wrong_type(error: ValidationError) -> ConfigError:
    value = error.instance
    fix = f"write a JSON {error.validator_value}"
    if error.validator_value == "integer" and isinstance(value, float) and value.is_integer():
        fix = f"write it without a fraction or exponent: {int(value)}"
    return ConfigError(json_path(error.absolute_path),
                       f"expected {error.validator_value}, got {_type_name(value)} {_show(value)}", fix)


def _not_in_enum(error: ValidationError) -> ConfigError:
    allowed = ", ".join(str(v) for v in error.validator_value)
    return ConfigError(json_path(error.absolute_path),
                       f"{_show(error.instance)} is not allowed; allowed values: {allowed}",
                       f"use one of: {allowed}")


def _bad_pattern(error: ValidationError) -> ConfigError:
    # The only pattern in the schema is the compute device.
    return ConfigError(json_path(error.absolute_path),
                       f"{_show(error.instance)} is not a compute device",
                       "use cpu, cuda:N or wgpu:N (N = device index, e.g. cuda:0)")


_BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}


def _out_of_bounds(error: ValidationError) -> ConfigError:
    bound = f"{_BOUNDS[error.validator]} {error.validator_value}"
    return ConfigError(json_path(error.absolute_path), f"must be {bound}, got {_show(error.instance)}",
                       f"use a value {bound}")


def _schema_error(error: ValidationError) -> ConfigError:
    handler = {"additionalProperties": _unknown_key, "required": _missing_key, "type": _wrong_type,
               "enum": _not_in_enum, "pattern": _bad_pattern, **dict.fromkeys(_BOUNDS, _out_of_bounds),
               }.get(error.validator)
    if handler:
        return handler(error)
    # Anything else (an empty string): jsonschema's own sentence names the rule and the value.
    return ConfigError(json_path(error.absolute_path), error.message,
                       "see docs/config.md for the allowed values")


def validate_schema(raw: Any) -> None:
    """Raise one ConfigError, for jsonschema's best match, if `raw` breaks the schema."""
    error = best_match(_validator().iter_errors(raw))
    if error is not None:
        raise _schema_error(error)


# ---------------------------------------------------------------- placement resolution


@dataclass(frozen=True)
class Placement:
    """Where a component computes and where its weights live."""

    compute: str
    store: str

    @property
    def backend(self) -> str:
        return self.compute.split(":")[0]

    @property
    def device(self) -> str:
        return self.compute


@dataclass(frozen=True)
class _Resolved:
    placement: Placement
    compute_from: tuple[int, str]  # (depth in the chain, JSON path of the key), depth -1 = built-in default
    store_from: tuple[int, str]
    block: str  # the most specific block that wrote compute or store


def _pick(chain: list[tuple[str, dict]], key: str, default: str, root: str) -> tuple[str, tuple[int, str]]:
    for depth in range(len(chain) - 1, -1, -1):
        path, block = chain[depth]
        if key in block:
            return block[key], (depth, _join(path, key))
    return default, (-1, _join(root, key))


def _resolve(chain: list[tuple[str, dict]]) -> _Resolved:
    """Apply the chain, least specific block first; the most specific block that sets a key wins."""
    root = chain[0][0]
    compute, compute_from = _pick(chain, "compute", DEFAULT_COMPUTE, root)
    store, store_from = _pick(chain, "store", DEFAULT_STORE, root)
    depth = max(compute_from[0], store_from[0])
    return _Resolved(Placement(compute, store), compute_from, store_from, chain[max(depth, 0)][0])


def _range_index(ranges: list[dict], layer: int | None) -> int | None:
    # `end` is exclusive (LumenLLM's meaning, Python's): a range holds layers start..end-1.
    if layer is None:
        return None
    return next((i for i, r in enumerate(ranges) if r["start"] <= layer < r["end"]), None)


def _chain(model: dict, root: str, component: str, layer: int | None = None,
           vision: dict | None = None) -> list[tuple[str, dict]]:
    """The blocks that decide a component's placement, least specific first."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; expected one of {', '.join(COMPONENTS)}")
    chain = [(root, model)]
    if component == "vision":
        # `vision` sits beside `model` in the file but inherits from it, like every other component.
        return chain + [("vision", vision or {})]
    if component in ("input-layer", "output-layer"):
        return chain + [(_join(root, component), model.get(component, {}))]
    hidden = model.get("hidden-layers", {})
    chain.append((_join(root, "hidden-layers"), hidden))
    chain += _layer_links(hidden, _join(root, "hidden-layers"), component, layer)
    if component == "attention":  # a layer's token mixer: where its layer is, unless model.attention says otherwise
        attention = model.get("attention", {})
        chain.append((_join(root, "attention"), {k: attention[k] for k in ("compute", "store") if k in attention}))
    return chain


def _layer_links(hidden: dict, hpath: str, component: str, layer: int | None) -> list[tuple[str, dict]]:
    # Precedence for experts, most specific last: hidden-layers, range, hidden-layers.experts, range.experts.
    ranges = hidden.get("ranges", [])
    index = _range_index(ranges, layer)
    links = [] if index is None else [(f"{hpath}.ranges[{index}]", ranges[index])]
    if component == "experts":
        links.append((f"{hpath}.experts", hidden.get("experts", {})))
        if index is not None:
            links.append((f"{hpath}.ranges[{index}].experts", ranges[index].get("experts", {})))
    return links


# ---------------------------------------------------------------- structural checks


def _source(origin: tuple[int, str]) -> str:
    return origin[1] + (" (default)" if origin[0] < 0 else "")


def _check_pair(resolved: _Resolved, component: str) -> None:
    place = resolved.placement
    if place.store != "vram" or place.backend != "cpu":
        return
    # Blame the more specific of the two written values: that is the one that introduced the conflict.
    compute_wins = resolved.compute_from[0] > resolved.store_from[0]
    blamed = resolved.compute_from if compute_wins else resolved.store_from
    both = (f"compute cpu from {_source(resolved.compute_from)}, "
            f"store vram from {_source(resolved.store_from)}")
    if component == "experts":
        message = f"experts computed on cpu need their weights in host memory ({both})"
        fix = "set experts.store to ram or mmap, or experts.compute to cuda:N / wgpu:N"
    else:
        message = f"store vram needs a GPU compute device, but {component} computes on cpu ({both})"
        fix = "set compute to cuda:N or wgpu:N, or store to ram or mmap"
    raise ConfigError(blamed[1], message, fix)


def _layers(start: int, end: int) -> str:
    """A range in exclusive terms, as written and as layers: `layers 0-23 (start 0, end 24)`."""
    held = f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"
    return f"{held} (start {start}, end {end})"


def _check_ranges_shape(ranges: list[dict], hpath: str) -> None:
    """Each range holds at least one layer (start < end: `end` is exclusive) and no layer is in two ranges."""
    for i, r in enumerate(ranges):
        if r["start"] > r["end"]:
            raise ConfigError(f"{hpath}.ranges[{i}].start", f"start {r['start']} is after end {r['end']}",
                              "swap start and end (end is exclusive: the range holds layers start..end-1)")
        if r["start"] == r["end"]:
            raise ConfigError(f"{hpath}.ranges[{i}].end",
                              f"the range is empty: start and end are both {r['start']}, and end is exclusive "
                              "(LumenLLM's meaning: the range holds layers start..end-1)",
                              f"set end to {r['end'] + 1} for layer {r['start']} alone, or remove the range")
        for j in range(i):
            if r["start"] < ranges[j]["end"] and ranges[j]["start"] < r["end"]:
                raise ConfigError(f"{hpath}.ranges[{i}]", _overlap_message(ranges, j, i),
                                  "make the ranges disjoint: each layer may belong to one range at most (end is "
                                  "exclusive, so a range may start at the previous one's end)")


def _overlap_message(ranges: list[dict], j: int, i: int) -> str:
    a, b = ranges[j], ranges[i]
    lo, hi = max(a["start"], b["start"]), min(a["end"], b["end"])
    shared = f"layer {lo}" if hi - lo == 1 else f"layers {lo}-{hi - 1}"
    return (f"ranges[{i}], {_layers(b['start'], b['end'])}, overlaps ranges[{j}], "
            f"{_layers(a['start'], a['end'])}, on {shared} (end is exclusive)")


def _check_placements(model: dict, root: str) -> None:
    ranges = model.get("hidden-layers", {}).get("ranges", [])
    # Layers outside every range use hidden-layers' own values; each range's first layer stands for the range.
    layers = [None] + [r["start"] for r in ranges]
    for component in ("input-layer", "output-layer"):
        _check_pair(_resolve(_chain(model, root, component)), component)
    for layer in layers:
        for component in ("layer", "experts"):
            _check_pair(_resolve(_chain(model, root, component, layer)), component)


def _check_fp8_attention(model: dict, root: str) -> None:
    if model.get("attention", {}).get("compute-quantization", "none") != "fp8":
        return
    kv = model.get("hidden-layers", {}).get("kv-cache", {})
    types = {k: kv.get(k, DEFAULT_KV_TYPE) for k in ("type-k", "type-v")}
    if any(t != "fp8" for t in types.values()):
        raise ConfigError(_join(root, "attention.compute-quantization"),
                          f"fp8 attention needs an fp8 KV cache, but type-k is {types['type-k']} "
                          f"and type-v is {types['type-v']}",
                          f"set {root}.hidden-layers.kv-cache.type-k and type-v to fp8, "
                          "or compute-quantization to none")


def _check_model(model: dict, root: str) -> None:
    hpath = _join(root, "hidden-layers")
    _check_ranges_shape(model.get("hidden-layers", {}).get("ranges", []), hpath)
    _check_placements(model, root)
    _check_fp8_attention(model, root)
    _check_attention(model, root)
    _check_sampling(model, root)


def _check_sampling(model: dict, root: str) -> None:
    """other-parameters through the sampler's own check (``SamplingParams.validate``), so a value `generate`
    would refuse is refused here, by `validate` too, with the sampler's words and the JSON path."""
    from lumen_core.sampling import SamplingParams

    params = model.get("other-parameters", {})
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    given = {key: _SAMPLING_NAMES[key] for key in params if _SAMPLING_NAMES.get(key) in fields}
    path = _join(root, "other-parameters")

    def refusal(values: dict) -> InputError | None:
        try:
            SamplingParams(**values).validate()
        except InputError as exc:
            return exc
        return None

    error = refusal({name: params[key] for key, name in given.items()})
    if error is None:
        return
    # The key to blame: the field the error names (SamplingError.field), else the first key the sampler refuses on
    # its own, else (values refused only together) the block.
    for key, name in given.items():
        if name == getattr(error, "field", None):
            raise ConfigError(_join(path, key), str(error), f"change {_join(path, key)} or remove it")
    for key, name in given.items():
        alone = refusal({name: params[key]})
        if alone is not None:
            raise ConfigError(_join(path, key), str(alone), f"change {_join(path, key)} or remove it")
    raise ConfigError(path, str(error), f"change the values in {path}")


def _check_vision(raw: dict) -> None:
    if "vision" in raw:
        _check_pair(_resolve(_chain(raw["model"], "model", "vision", vision=raw["vision"])), "vision")


DEFAULT_DRAFT_TOKENS = 4  # LumenLLM's default of draft.num-draft-tokens
_FLAT_DRAFT = ("path", "compute", "store")


def normalize(raw: dict) -> None:
    """LumenLLM's spellings, rewritten in place (after the schema) to the one Lumen reads, with the same meaning:
    `store: "gpu"` is `vram` wherever a store is taken (LumenLLM's guide: `"vram"` (= `"gpu"`)); a flat `draft`
    {path, compute, store} is `draft.model` (omitted compute/store inherit from `model`, as LumenLLM's guide says);
    `num-draft-tokens` omitted is 4. A draft is then either `{model, num-draft-tokens}` or, drafting with the
    checkpoint's MTP head, `{mtp: true, num-draft-tokens}` (`mtp: false` is dropped: it is the draft-model form);
    `fallback`, a boolean in any form, is kept where written (omitted: true, ``Config.draft()``).
    What cannot be read so (both draft forms, an MTP head with a draft model, a `cuda` knob) is refused by name."""
    _check_cuda(raw.get("cuda", {}))
    if "draft" in raw:
        raw["draft"] = _nested_draft(raw["draft"], raw["model"])
    stack: list[Any] = [raw]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if value.get("store") == "gpu":
                value["store"] = "vram"
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _check_cuda(knobs: dict) -> None:
    for key in knobs:
        if key == "compute-quantization":  # Lumen's own key (the schema checks its value)
            continue
        raise ConfigError(f"cuda.{key}", "LumenLLM's CUDA runtime knobs are not supported: its guide documents none, "
                          "and Lumen's CUDA backend takes one setting from the config, compute-quantization",
                          "remove the key (an empty cuda block is accepted and has no effect)")


def _nested_draft(draft: dict, model: dict) -> dict:
    """The one form Lumen reads of a draft block written in any of the three (see ``normalize``)."""
    flat = [k for k in _FLAT_DRAFT if k in draft]
    tokens = draft.get("num-draft-tokens", DEFAULT_DRAFT_TOKENS)
    fallback = {"fallback": draft["fallback"]} if "fallback" in draft else {}
    if fallback and not isinstance(draft["fallback"], bool):  # the schema says so first, in a file or a dict
        raise ConfigError("draft.fallback", f"{draft['fallback']!r} is not a boolean",
                          "write true (plain decoding where it is measured faster: the default) or false (always "
                          "speculate)")
    if draft.get("mtp"):
        given = flat + (["model"] if "model" in draft else [])
        if given:
            raise ConfigError("draft.mtp", f"mtp: true drafts with the checkpoint's own multi-token-prediction head, "
                              f"but draft.{given[0]} also names a draft model",
                              f"remove draft.{', draft.'.join(given)} (MTP head), or set mtp to false (draft model)")
        return {"mtp": True, "num-draft-tokens": tokens, **fallback}
    if "model" in draft and flat:
        raise ConfigError(f"draft.{flat[0]}", "draft is given twice: LumenLLM's flat form (draft.path, compute, "
                          "store) and Lumen's draft.model block", "keep one of the two forms")
    if "model" not in draft and "path" not in draft:
        raise ConfigError("draft.path", "missing the draft checkpoint: draft needs 'path' (LumenLLM's flat form) "
                          "or a 'model' block (Lumen's form), or 'mtp': true (the checkpoint's MTP head)",
                          "add draft.path, or draft.mtp: true to draft with the model's multi-token-prediction head")
    if "model" in draft:
        nested = {"model": draft["model"]}
    else:  # omitted compute/store inherit from model (LumenLLM: "anything you omit inherits from its parent")
        nested = {"model": {k: draft.get(k, model.get(k)) for k in _FLAT_DRAFT if k in draft or k in model}}
    nested["num-draft-tokens"] = tokens
    nested.update(fallback)
    return nested


def _check_attention(model: dict, root: str) -> None:
    """LumenLLM's attention block places every layer's token mixer (full attention and Gated-DeltaNet weights, and
    the layer's KV cache or recurrent state) apart from the rest of the layer: ``store`` and ``compute`` may differ
    from the layer's (an architecture that cannot compute its mixers apart is refused by the plan). mechanism
    reference is the CPU backend's attention; a GPU backend's own attention cannot be swapped for a reference one
    yet."""
    attention = model.get("attention", {})
    ranges = model.get("hidden-layers", {}).get("ranges", [])
    for layer in [None] + [r["start"] for r in ranges]:
        layer_block = _resolve(_chain(model, root, "layer", layer)).block
        resolved = _resolve(_chain(model, root, "attention", layer))
        place = resolved.placement
        if place.store == "vram" and place.backend == "cpu":
            key = "store" if "store" in attention else "compute"
            raise ConfigError(_join(root, f"attention.{key}"),
                              f"store vram needs a GPU compute device, but the attention of the layers of "
                              f"{layer_block} computes on cpu (compute from {_source(resolved.compute_from)}, store "
                              f"from {_source(resolved.store_from)})",
                              "set attention.compute to cuda:N / wgpu:N, or attention.store to ram or mmap")
        if attention.get("mechanism") == "reference" and place.backend != "cpu":
            raise ConfigError(_join(root, "attention.mechanism"),
                              f"reference attention on {place.compute} is not supported yet (issue 16): "
                              f"the attention of the layers of {layer_block} computes on {place.backend}, whose "
                              "backend runs its own (tuned) attention; only the CPU backend's attention is the "
                              "reference one",
                              "use mechanism aegis-varlen or standard (the backend's own attention)")


def check_structure(raw: dict, draft_root: str = "draft.model") -> None:
    """The semantic checks that need no checkpoint or device; raises the first ConfigError. `draft_root`: the JSON
    path of the draft's model block as the file wrote it (`draft` for LumenLLM's flat form)."""
    _check_model(raw["model"], "model")
    _check_vision(raw)
    if "model" in raw.get("draft", {}):
        _check_model(raw["draft"]["model"], draft_root)


# ---------------------------------------------------------------- the Config object


@dataclass(frozen=True)
class KVCacheConfig:
    """`context_size` None: use the model's max_position_embeddings. `store` None: each layer's device.
    `allow_beyond_trained_context`: a context_size past the model's trained context is the user's call (RoPE
    scaling is theirs); otherwise the plan refuses it."""

    context_size: int | None
    store: str | None
    type_k: str
    type_v: str
    allow_beyond_trained_context: bool = False
    sequences: int = 1  # generations held at once (the server's batch), each with a full cache
    prefix_cache_mb: float = 0.0  # host RAM for the prefix cache (0: off)


@dataclass(frozen=True)
class DraftSpec:
    """Speculative decoding as the config asks for it (``Config.draft()``): ``tokens`` proposed per verification
    step (num-draft-tokens); ``mtp``: drafted by the checkpoint's multi-token-prediction head; ``config``: the draft
    model's own Config (its model block as its root, paths relative to the main config's directory), None for MTP.
    The plan fixes the draft's context size to the main model's (``resolved["draft_config"]``). ``fallback``
    (draft.fallback): plain rounds where they are measured faster (``lumen_core.speculative.Fallback``); False:
    every round drafts."""

    tokens: int
    mtp: bool
    config: Config | None
    fallback: bool = True


def _expanduser(text: str, where: str) -> Path:
    try:
        return Path(text).expanduser()
    except RuntimeError:  # ~name of a user this system does not have
        raise ConfigError(where, f"{_show(text)}: cannot expand '~': no such user's home directory",
                          "write the path without ~, or with ~/ for your own home") from None


def _resolve_model_path(text: str, base_dir: Path, where: str = "model.path", model: dict | None = None) -> Path:
    """A path relative to `base_dir`; for a model block (`model` given), a Hugging Face model id (`org/name`)
    that is not a path on disk is looked up in the local Hugging Face cache at the block's `revision`."""
    path = _expanduser(text, where)
    path = path if path.is_absolute() else (base_dir / path)
    if model is None:
        return path
    from lumen_core.checkpoint.hub import is_model_id, resolve_model_id

    revision = model.get("revision")
    try:
        on_disk = path.exists()
    except OSError:  # a name too long: the checkpoint reader says so
        on_disk = True
    if on_disk or not is_model_id(text):
        if revision is not None:
            raise ConfigError(where.removesuffix("path") + "revision",
                              f"{_show(revision)} picks a revision of a Hugging Face model id, but {where} "
                              f"{_show(text)} is {'a path on disk' if on_disk else 'not an id (org/name)'}",
                              f"remove the revision, or set {where} to a model id such as Qwen/Qwen3.5-9B")
        return path
    return resolve_model_id(text, revision)


class Config:
    """A validated config. Build it with `load_config`; this class trusts its input."""

    def __init__(self, raw: dict, source: str, base_dir: str | os.PathLike | None = None):
        self.raw = raw
        self.source = source
        self.base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
        self._model_path: Path | None = None
        for block, where in ((raw["model"], "model.path"), (raw.get("draft", {}).get("model"), "draft.model.path")):
            if block:  # a path that cannot expand is refused now; a model id is looked up when first used
                _expanduser(block["path"], where)
        _ = self.chat_template_path

    def __repr__(self) -> str:
        return f"Config(source={self.source!r}, model_path={self.raw['model']['path']!r})"

    @property
    def model_path(self) -> Path:
        """model.path resolved: a path on disk, or a Hugging Face model id's snapshot in the local cache (looked
        up on first use, so load_config reads no cache; an id not cached is a CheckpointError then)."""
        if self._model_path is None:
            self._model_path = _resolve_model_path(self.raw["model"]["path"], self.base_dir, "model.path",
                                                   self.raw["model"])
        return self._model_path

    @property
    def chat_template_path(self) -> Path | None:
        """model.chat-template: a Jinja file to chat with instead of the checkpoint's template (None: not set)."""
        text = self.raw["model"].get("chat-template")
        return _resolve_model_path(text, self.base_dir, "model.chat-template") if text else None

    @property
    def draft_model_path(self) -> Path | None:
        """draft.model.path resolved as model.path is; None without a draft model (no draft, or the MTP head)."""
        draft = self.raw.get("draft")
        if not draft or "model" not in draft:
            return None
        return _resolve_model_path(draft["model"]["path"], self.base_dir, "draft.model.path", draft["model"])

    def draft(self) -> DraftSpec | None:
        """The draft block read (None: no speculative decoding). A draft model's Config has the draft's model block
        as its `model`, the main config's directory as its base and source ``<main source> (draft)``; it is checked
        already (``check_structure``), so it is built as is."""
        draft = self.raw.get("draft")
        if not draft:
            return None
        fallback = draft.get("fallback", True)
        if draft.get("mtp"):
            return DraftSpec(draft["num-draft-tokens"], True, None, fallback)
        own = Config({"model": copy.deepcopy(draft["model"])}, f"{self.source} (draft)", self.base_dir)
        return DraftSpec(draft["num-draft-tokens"], False, own, fallback)

    def with_draft(self, path: str | None = None, tokens: int | None = None, mtp: bool = False,
                   fallback: bool | None = None) -> Config:
        """A copy of this config with the command line's draft options (`--draft-model PATH`, `--draft-tokens N`,
        `--mtp`, `--no-draft-fallback`) on top, checked as a config file is. `path` replaces the config's draft with
        LumenLLM's flat form (compute and store inherit from `model`); `mtp` with the MTP head; `tokens` sets
        num-draft-tokens (else the config's, else 4); `fallback` sets draft.fallback (else the config's, else true).
        A relative `path` is relative to the working directory (it comes from the command line), unless it is a
        Hugging Face model id not on disk. Nothing given: this config itself."""
        if path is None and tokens is None and not mtp and fallback is None:
            return self
        if path is not None and not path.strip():
            raise InputError("--draft-model: the path is empty; give the draft checkpoint's directory, .gguf file or "
                             "Hugging Face model id")
        if path is not None and mtp:
            raise InputError("give --draft-model PATH (a draft model) or --mtp (the checkpoint's multi-token-"
                             "prediction head), not both")
        old = self.raw.get("draft")
        if path is None and not mtp and not old:
            where = "a config file" if self.source == "<dict>" else f"the config {self.source}"
            option = f"--draft-tokens {tokens}" if tokens is not None else "--no-draft-fallback"
            raise InputError(f"{option} needs a draft: add --draft-model PATH or --mtp, or a draft block to {where}")
        raw = copy.deepcopy(self.raw)
        if path is not None or mtp:
            raw["draft"] = {"mtp": True} if mtp else {"path": _cli_path(path)}
            if old:
                raw["draft"]["num-draft-tokens"] = old["num-draft-tokens"]
                if "fallback" in old:
                    raw["draft"]["fallback"] = old["fallback"]
        if tokens is not None:
            raw["draft"]["num-draft-tokens"] = tokens
        if fallback is not None:
            raw["draft"]["fallback"] = fallback
        _check_values(raw)  # a NUL in the path, as in a file
        return _checked(raw, self.source, self.base_dir)

    def with_threads(self, threads: int | None) -> Config:
        """A copy with the command line's `--threads N` as cpu.threads (None: this config itself)."""
        if threads is None:
            return self
        raw = copy.deepcopy(self.raw)
        raw.setdefault("cpu", {})["threads"] = threads
        return _checked(raw, self.source, self.base_dir)

    def _resolved(self, component: str, layer: int | None) -> _Resolved:
        if component == "mtp":  # the multi-token-prediction head reads the lm_head: it sits with the output layer
            component = "output-layer"
        return _resolve(_chain(self.raw["model"], "model", component, layer, self.raw.get("vision")))

    def placement(self, component: str, layer: int | None = None) -> Placement:
        """Effective placement of input-layer, output-layer, layer N, the token mixer (attention) of layer N, the
        experts of layer N, vision, or mtp (the multi-token-prediction head: the output layer's placement)."""
        return self._resolved(component, layer).placement

    def placement_path(self, component: str, layer: int | None = None) -> str:
        """The most specific block that wrote the component's compute or store (`model` if none did)."""
        return self._resolved(component, layer).block

    def ranges(self) -> list[dict]:
        """The layer ranges, each a copy with its position in the list under `index`."""
        ranges = self.raw["model"].get("hidden-layers", {}).get("ranges", [])
        return [{"index": i, **copy.deepcopy(r)} for i, r in enumerate(ranges)]

    def check_ranges(self, num_layers: int) -> None:
        """Refuse a range that reaches past the model's layers (needs the checkpoint's layer count). `end` is
        exclusive (LumenLLM's meaning), so it may equal the layer count: `{"start": 24, "end": 48}` ends at the
        last layer of a 48-layer model."""
        for r in self.ranges():
            if r["end"] > num_layers:
                raise ConfigError(f"model.hidden-layers.ranges[{r['index']}].end",
                                  f"end {r['end']} is past the model's layers: the model has {num_layers} "
                                  f"layers (0-{num_layers - 1}), and end is exclusive, so it may be at most "
                                  f"{num_layers}",
                                  f"set end to at most {num_layers}")

    def range_notes(self, num_layers: int) -> list[str]:
        """Notes on ranges whose `end` reads as if it were meant inclusive, where that leaves a layer in no range
        and so on hidden-layers' placement: a gap of exactly one layer between two consecutive ranges, or a last
        range that ends one short of the model's layer count. Only where the layer's placement (or its experts')
        would differ if that range held it; such a config is not refused (a gap is legitimate), but said out loud."""
        ranges = sorted(self.ranges(), key=lambda r: r["start"])
        notes = []
        for k, r in enumerate(ranges):
            nxt = ranges[k + 1]["start"] if k + 1 < len(ranges) else num_layers
            layer = r["end"]
            if nxt != layer + 1 or not self._range_would_move(r["index"], layer):
                continue
            notes.append(f"config model.hidden-layers.ranges[{r['index']}].end: ranges end is exclusive "
                         f"(LumenLLM's meaning): layer {layer} is in no range and uses hidden-layers' placement; "
                         f"if you meant it inclusive, set end to {layer + 1}")
        return notes

    def _range_would_move(self, index: int, layer: int) -> bool:
        """Whether `layer` (in no range) would be placed otherwise, or its experts, if ranges[index] held it."""
        model = copy.deepcopy(self.raw["model"])
        model["hidden-layers"]["ranges"][index]["end"] = layer + 1
        return any(_resolve(_chain(self.raw["model"], "model", c, layer)).placement
                   != _resolve(_chain(model, "model", c, layer)).placement for c in ("layer", "experts"))

    def cpu_threads(self) -> int | None:
        """cpu.threads: the CPU backend's compute threads (None: its default, one per core)."""
        return self.raw.get("cpu", {}).get("threads")

    def cpu_compute_quantization(self) -> str:
        """cpu.compute-quantization: "int8" (the CPU's GEMVs with int8-layout weights and one token's NVFP4 experts
        quantize x to 8 bits), "bf16" (NVFP4 experts' several-token products in bf16 AMX tiles) or "none" (the
        default)."""
        return self.raw.get("cpu", {}).get("compute-quantization", "none")

    def attention_compute_quantization(self) -> str:
        """model.attention.compute-quantization: "fp8" (attention in FP8 MMA over the fp8 KV cache, where a backend
        computes it), or the backend's own precision ("none"; LumenLLM's "default" and "bf16" mean the same here)."""
        value = self.raw["model"].get("attention", {}).get("compute-quantization", "none")
        return "fp8" if value == "fp8" else "none"

    def cuda_compute_quantization(self) -> str:
        """cuda.compute-quantization: "bf16" (the cuda backends' several-token products round the activations to
        bf16) or "none" (the default: exact)."""
        return self.raw.get("cuda", {}).get("compute-quantization", "none")

    def expert_cache(self) -> int | None:
        """model.hidden-layers.experts.cache: experts kept in VRAM per GPU for streamed experts (None: default)."""
        return self.raw["model"].get("hidden-layers", {}).get("experts", {}).get("cache")

    def kv_cache(self) -> KVCacheConfig:
        kv = self.raw["model"].get("hidden-layers", {}).get("kv-cache", {})
        return KVCacheConfig(kv.get("context-size"), kv.get("store"),
                             kv.get("type-k", DEFAULT_KV_TYPE), kv.get("type-v", DEFAULT_KV_TYPE),
                             kv.get("allow-beyond-trained-context", False), kv.get("sequences", 1),
                             kv.get("prefix-cache-mb", 0.0))

    def sampling_defaults(self) -> dict:
        params = self.raw["model"].get("other-parameters", {})
        return {_SAMPLING_NAMES[k]: copy.deepcopy(v) for k, v in params.items()}

    def server_parameters(self) -> dict:
        """server-parameters by their Python names; an API key that cannot work (empty, blank, whitespace around
        it: the schema's minLength lets "  " through) is a ConfigError naming it, as `--api-key` is refused."""
        from lumen_core.server.settings import api_key_problem  # no FastAPI: settings imports nothing else

        params = self.raw.get("server-parameters", {})
        for i, key in enumerate(params.get("api-keys", [])):
            problem = api_key_problem(key)
            if problem:
                raise ConfigError(f"server-parameters.api-keys[{i}]", problem,
                                  "write the key itself, or remove it (no keys: no authentication)")
        return {_SERVER_NAMES[k]: copy.deepcopy(v) for k, v in params.items()}

    def requested_features(self) -> list[tuple[str, str]]:
        """(json_path, feature) of what the engine may not support yet; it refuses those it can't do."""
        model = self.raw["model"]
        wanted = [("audio", "audio tower", "audio" in self.raw),
                  ("model.attention.compute-quantization", "fp8 attention",
                   model.get("attention", {}).get("compute-quantization", "none") == "fp8")]
        return [(path, feature) for path, feature, on in wanted if on]


# ---------------------------------------------------------------- entry points


def load_config(source: str | os.PathLike | dict, base_dir: str | os.PathLike | None = None) -> Config:
    """Read, validate and check a config file (or an already-parsed dict); raise ConfigError if it can't run.

    Relative `model.path` is resolved against the file's directory, or `base_dir` (cwd if None) for a dict.
    """
    if isinstance(source, dict):
        _check_values(source)  # before deepcopy, which recurses
        raw, name = copy.deepcopy(source), "<dict>"
    else:
        path = _expanduser(os.fspath(source), "")
        raw, name, base_dir = _read_json(path), str(path), path.resolve().parent
        _check_values(raw)
    return _checked(raw, name, base_dir)


def _checked(raw: dict, name: str, base_dir) -> Config:
    """Schema, normalization and structural checks of a raw config read or built (it is changed in place)."""
    validate_schema(raw)
    flat_draft = isinstance(raw.get("draft"), dict) and "model" not in raw["draft"]
    normalize(raw)
    check_structure(raw, "draft" if flat_draft else "draft.model")
    config = Config(raw, name, base_dir)
    config.server_parameters()  # what `serve` refuses in its block (a blank API key) every command refuses
    return config


def _cli_path(text: str) -> str:
    """A checkpoint path given on the command line, absolute against the working directory (a config's paths are
    relative to its own directory); a Hugging Face model id that is not on disk stays as it is."""
    path = _expanduser(text, "--draft-model")
    if path.is_absolute() or (_is_model_id(text) and not _exists(path)):
        return text
    return str(Path.cwd() / path)


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long: not a checkpoint dir; reading it as a config file says why it fails
        return False


def config_from_path_or_model(arg: str | os.PathLike | dict) -> Config:
    """A checkpoint dir, .gguf file or Hugging Face model id (`org/name`, not a file on disk) gets the minimal
    all-CPU config; anything else is a config file."""
    if not isinstance(arg, dict):
        text = os.fspath(arg)
        path = _expanduser(text, "")
        if _is_dir(path) or text.lower().endswith(".gguf") or (_is_model_id(text) and not _exists(path)):
            return load_config({"model": {"path": text, "compute": "cpu", "store": "ram"}})
    return load_config(arg)


def _is_model_id(text: str) -> bool:
    from lumen_core.checkpoint.hub import is_model_id

    return is_model_id(text)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:
        return True  # a name too long: reading it as a config file says why it fails
