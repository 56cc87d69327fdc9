"""Fuzz the config (issue 15) with configs derived from the JSON Schema, two ways:

* broad: every key of the schema present or not, mostly with a value the schema accepts (edge values included),
  otherwise a wrong one (another type, out of bounds, 5.0 for 5, a non-finite number, a device with a newline, a
  random JSON value nested a few levels), random extra keys, blocks replaced by junk;
* deep: a config whose every value the schema accepts, kept as it is half the time, otherwise changed at one spot
  (a value replaced, a key dropped or added): so the mistakes also sit deep inside configs that would run;
* sampling: the path and other-parameters only (edge values: subnormal and huge temperatures and penalties), so
  the sampler's own checks meet many values that reach it.

Files are plain JSON (NaN/Infinity literals where a value is one), now and then with the infinities written as
overflowing literals (1e999) or the whole config nested 3000 arrays deep.

The properties:

* `load_config` raises nothing but a ConfigError with a fix, from the file and from the dict;
* `lumen validate` and `lumen generate` (in process, through ``lumen_core.cli.main``, 2 new tokens) on the tiny
  Qwen 3.5 checkpoints (dense, MoE) never let an exception out (what a user sees as a traceback), exit 0 or 2
  only, and agree: validate exits 2 if and only if generate exits 2 for the config, with the same message; a config
  validate passes, generate runs (the only exit 2 allowed then is the prompt not fitting a context the config made
  tiny: an input error about the prompt, not about the config).

Derandomized (the same cases every run, stable in CI), without the example database. What a run tried and how it
ended is counted in ``FUZZ_REPORT`` and printed (``pytest -s``).
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from lumen_core.cli import main
from lumen_core.config import load_config, schema
from lumen_core.errors import ConfigError

FUZZ_REPORT: Counter = Counter()
KEYS_RUN: Counter = Counter()  # keys present in the configs that generated text
SETTINGS = dict(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])

# ---------------------------------------------------------------- strategies from the schema

SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
JUNK = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids,
                                                                                        max_size=3), max_leaves=6)
NEAR_MISS = ["stor", "comput", "Compute", "context_size", "kv_cache", "ranges ", "experts", "top_k", "seed", "path",
             "hidden-layer", "cache", "allow-beyond", "mechanism"]
DEVICES = ["cpu", "cuda:0", "wgpu:0", "cuda:1", "cpu\n", " cpu", "cuda:\u0663", "CPU", "cuda:", "cuda:00", ""]
# Values worth trying, beside a small random range; those outside a key's bounds count as wrong values.
INTERESTING_INTS = {"context-size": [1, 2, 3, 16, 64, 4096, 4097, 10**6, 2**31 - 1, 2**31, 10**30],
                    "start": [0, 1, 2, 3, 4, 9], "end": [0, 1, 2, 3, 4, 5, 9], "seed": [0, 1, 2**64, 10**40, -1],
                    "top-k": [0, 1, 5, 10**9, -1], "max-tokens": [1, 10**9, 0], "cache": [1, 4, 10**9, 0]}
CPU_REFUSES = {"store": {"vram", "gpu"}, "compute-quantization": {"fp8"}}  # on this CPU, by key (gpu = vram)
# Tiny and huge positives: where a sampler's float64 arithmetic overflows (logits / 1e-320 is inf).
INTERESTING_NUMBERS = [0, 0.0, 5e-324, 1e-320, 1e-300, 1e-10, 1e-6, 1e-5, 0.5, 1, 1.0, 2.5, 1e5, 1e6, 1e300, 1e308,
                       -0.0, -1, 10**400]


def mostly(valid, invalid, weight: int = 6):
    """`valid` about `weight` times in `weight + 1`; shrinks towards `valid`; `invalid` False: always `valid`. (Not
    one_of with `valid` repeated: the repr of nested strategies, which hypothesis builds, would grow as
    weight ** depth.)"""
    if invalid is False:
        return valid
    return st.integers(0, weight).flatmap(lambda i: valid if i < weight else invalid)


def _in_bounds(node: dict, value) -> bool:
    return (value >= node.get("minimum", value) and value <= node.get("maximum", value)
            and value > node.get("exclusiveMinimum", value - 1))


def leaf(key: str, node: dict, env: dict, bad: bool):
    """One key's value: what the schema accepts (edge values included), or with `bad`, now and then a wrong one."""
    kind = node.get("type")
    if key == "path":
        return mostly(st.sampled_from(env["checkpoints"]),
                      bad and (st.sampled_from(["", "nope", "a\u0000b", "~/x.gguf", "~lumen-no-such-user/m", "m" * 300])
                               | JUNK), 10)
    if key == "chat-template":  # a good file mostly; a broken, non-UTF-8, missing one or a directory now and then
        return mostly(mostly(st.just(env["templates"][0]), st.sampled_from(env["templates"][1:]), 6), bad and JUNK, 3)
    if "pattern" in node:
        return mostly(st.just("cpu"), bad and (st.sampled_from(DEVICES) | st.text(max_size=8) | JUNK), 3)
    if "enum" in node:
        # vram (needs a GPU) and fp8 attention (cuda only) are refused on this CPU: now and then only, so
        # that most configs get as far as generating.
        runs = [v for v in node["enum"] if v not in CPU_REFUSES.get(key, ())]
        return mostly(mostly(st.sampled_from(runs), st.sampled_from(node["enum"]), 4),
                      bad and (st.text(max_size=6) | JUNK))
    if kind == "integer":
        lo = node.get("minimum", 0)
        values = INTERESTING_INTS.get(key, [lo, lo + 1, 10**9])
        span = 3 if key in ("start", "end") else 6  # the tiny models have 4 layers
        small, edges = st.integers(lo, lo + span), st.sampled_from([v for v in values if _in_bounds(node, v)])
        good = mostly(small, edges, 4 if not bad else 1)  # a valid base: mostly values that also run
        wrong = [v for v in values if not _in_bounds(node, v)]
        return mostly(good, bad and (good.map(float) | st.floats() | st.integers() | JUNK
                                     | st.sampled_from(wrong or [lo - 1])))
    if kind == "number":
        lo = node.get("minimum", node.get("exclusiveMinimum", 0))
        edges = st.sampled_from([v for v in INTERESTING_NUMBERS if _in_bounds(node, v)])
        if bad:  # edges two times in three: the sampler's own bounds are tighter than the schema's
            good = mostly(edges, st.floats(lo, node.get("maximum", 10.0)).filter(lambda v: _in_bounds(node, v)), 2)
        else:  # a valid base: values that also run, the edges now and then
            moderate = st.floats(max(lo, 0.01), node.get("maximum", 10.0)) | st.sampled_from(
                [node["minimum"]] if "minimum" in node else [1])
            good = mostly(moderate, edges, 4)
        return mostly(good, bad and (st.floats() | st.integers() | JUNK))
    if kind == "boolean":
        return mostly(st.booleans(), bad and JUNK)
    if kind == "string":
        return mostly(st.text(min_size=1, max_size=8), bad and JUNK)
    if kind == "array" and node["items"].get("type") == "string":
        return mostly(st.lists(st.text(min_size=1, max_size=4), max_size=3), bad and JUNK)
    raise AssertionError(f"no strategy for {key}: {node}")  # a new kind of key: teach the fuzz about it


def block(node: dict, env: dict, defs: dict, bad: bool, key: str = ""):
    """An object of the schema: any subset of its keys (with `bad`: required ones now and then dropped, a random
    extra key now and then, now and then the whole block replaced by junk)."""
    if "$ref" in node:
        node = {**defs[node["$ref"].split("/")[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
    if node.get("type") == "array" and node["items"].get("type") != "string":  # ranges
        items = block(node["items"], env, defs, bad, key)
        if not bad:  # a valid base: mostly disjoint ranges inside the 4 layers, with no per-range expert cache
            return mostly(_disjoint(items), st.lists(items, max_size=2), 4)
        return mostly(st.lists(items, max_size=3), JUNK)
    if node.get("type") != "object":
        return leaf(key, node, env, bad)
    required = set(node.get("required", []))
    subs = {k: block(sub, env, defs, bad, k) for k, sub in node["properties"].items()}
    if key == "$root":  # the root: vision and draft (refused by name for now) and server-parameters now and then
        rare = {k: subs.pop(k) for k in ("vision", "draft", "server-parameters")}
        return st.builds(lambda m, o: {"model": m, **o}, subs["model"],
                         mostly(st.just({}), st.fixed_dictionaries({}, optional=rare), 4))
    if not bad:  # most keys present, so that the deep ones (kv-cache, ranges, experts) are often there
        return _object(subs, required)
    obj = st.fixed_dictionaries({k: v for k, v in subs.items() if k in required},
                                optional={k: v for k, v in subs.items() if k not in required})
    extras = mostly(st.just({}), st.dictionaries(st.sampled_from(NEAR_MISS) | st.text(max_size=6), JUNK,
                                                 min_size=1, max_size=2), 8)
    whole = st.builds(lambda o, e: {**e, **o}, obj, extras)
    without_required = obj.map(lambda o: {k: v for k, v in o.items() if k not in required})
    return mostly(whole, JUNK | without_required, 30 if key == "model" else 8)


@st.composite
def _object(draw, subs: dict, required: set):
    """The keys in `required`, and each other key three times in four."""
    return {k: draw(v) for k, v in subs.items() if k in required or draw(st.integers(0, 3))}


@st.composite
def _disjoint(draw, items):
    """Up to two ranges over layers 0-3 that do not overlap (end is exclusive: at most 4; their other keys drawn as
    usual, experts.cache left out: it is per GPU, refused in a range)."""
    ranges, first = [], 0
    for _ in range(draw(st.integers(0, 2))):
        if first > 3:
            break
        start = draw(st.integers(first, 3))
        end = draw(st.integers(start + 1, 4))
        item = {**draw(items), "start": start, "end": end}
        if isinstance(item.get("experts"), dict):
            item["experts"] = {k: v for k, v in item["experts"].items() if k != "cache"}
        ranges.append(item)
        first = end
    return ranges


def _spots(raw, out: list) -> list:
    """(container, key) of every value in the config, the root excluded."""
    items = raw.items() if isinstance(raw, dict) else enumerate(raw) if isinstance(raw, list) else ()
    for k, v in items:
        out.append((raw, k))
        _spots(v, out)
    return out


@st.composite
def mutated(draw, valid):
    """A config the schema accepts, half the time changed at one spot (inside the model block, or the model block
    itself where the config has other blocks: replaced or dropped, it hides all that is inside it)."""
    raw = json.loads(json.dumps(draw(valid)))  # a copy of its own to change
    if draw(st.booleans()):
        return raw
    spots = _spots(raw["model"], [(raw, "model")] if len(raw) > 1 else [])
    how = draw(st.sampled_from(["junk", "device", "number", "float", "drop", "extra"]))
    fits = {"float": lambda v: isinstance(v, int) and not isinstance(v, bool), "extra": lambda v: isinstance(v, dict),
            "drop": lambda v: True}.get(how, lambda v: True)
    # A spot the change applies to (5.0 for an integer, an extra key in an object); model.path only where nothing
    # else is: the broad configs get it wrong often enough.
    spots = [s for s in spots if fits(s[0][s[1]]) and (s[1] != "path" or how == "drop")] or spots
    container, key = draw(st.sampled_from(spots))
    value = container[key]
    if how == "drop" and isinstance(container, dict):
        del container[key]
    elif how == "extra" and isinstance(value, dict):
        value[draw(st.sampled_from(NEAR_MISS))] = draw(JUNK)
    elif how == "float" and fits(value) and abs(value) < 2**1023:  # float() of a larger int overflows
        container[key] = float(value)
    else:
        container[key] = draw({"device": st.sampled_from(DEVICES), "number": st.sampled_from(INTERESTING_NUMBERS)}
                              .get(how, JUNK))
    return raw


def configs(env: dict):
    s = schema()
    broad = mostly(block(s, env, s["$defs"], True, "$root"), JUNK, 20)
    # The sampling defaults alone: what the sampler sees, without a placement mistake to stop the run first.
    sampling = st.builds(lambda path, params: {"model": {"path": path, "other-parameters": params}},
                         st.sampled_from(env["checkpoints"]), block(s["$defs"]["other-parameters"], env, s["$defs"],
                                                                    True, "other-parameters"))
    deep = mutated(block(s, env, s["$defs"], False, "$root"))
    mix = [broad, broad, deep, deep, deep, sampling]  # 2 : 3 : 1
    return st.integers(0, len(mix) - 1).flatmap(lambda i: mix[i])


def config_text(raw, style: str) -> str:
    text = json.dumps(raw)
    if style == "overflow":
        return re.sub(r"Infinity", "1e999", text)
    if style == "deep":
        return "[" * 3000 + text + "]" * 3000
    return text


STYLES = st.sampled_from(["json"] * 12 + ["overflow", "deep"])

# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def env(tiny_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-templates")
    (d / "ok.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (d / "broken.jinja").write_text("{% for m in messages %}")
    (d / "latin1.jinja").write_bytes(b"\xff\xfe{{ x }}")
    return {"checkpoints": [str(tiny_checkpoint("qwen3_5")), str(tiny_checkpoint("qwen3_5_moe"))],
            "templates": [str(d / "ok.jinja"), str(d / "broken.jinja"), str(d / "latin1.jinja"),
                          str(d / "missing.jinja"), str(d)]}


def _run(capsys, *argv) -> tuple[int, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    # Any other exception escapes: hypothesis reports it with the config that raised it.
    return code, capsys.readouterr().err


def _error(err: str) -> str:
    """The error text (from `lumen: error:`); notes before it may differ between the two commands."""
    at = err.find("lumen: error:")
    return err[at:] if at >= 0 else ""


RUNTIME_INPUT = re.compile(r"^lumen: error: the prompt has \d+ tokens but the context size is \d+")


def _keys(raw, prefix: str = "") -> set[str]:
    out = set()
    items = raw.items() if isinstance(raw, dict) else (("[i]", v) for v in raw) if isinstance(raw, list) else ()
    for k, v in items:
        name = prefix + k if k == "[i]" or not prefix else f"{prefix}.{k}"
        out |= {name} | _keys(v, name)
    return out


def _kind(err: str) -> str:
    """A bucket for the report: the config key an error names, or the start of the message."""
    m = re.match(r"lumen: error: config (\S*):", _error(err))
    if m and m.group(1).startswith(("model", "vision", "draft", "server")):
        return "config " + re.sub(r"\[\d+\]", "[i]", m.group(1))
    return "config (root or an extra key)" if m else _error(err)[14:44] + "..."


def _report(prefix: str) -> None:
    print(f"\nconfig fuzz ({prefix}):")
    for key, n in sorted(FUZZ_REPORT.items(), key=lambda kv: (-kv[1], kv[0])):
        if key.startswith(prefix):
            print(f"  {n:5d}  {key}")
    if prefix == "cli":
        print("  keys in configs that generated: " + ", ".join(f"{k} {n}" for k, n in sorted(KEYS_RUN.items())))

# ---------------------------------------------------------------- the properties


def test_load_config_raises_only_config_errors(env, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz-load") / "c.json"

    @settings(max_examples=1500, **SETTINGS)
    @given(raw=configs(env), style=STYLES)
    def check(raw, style):
        path.write_text(config_text(raw, style))
        note(f"config file ({style}): {path.read_text()[:3000]}")
        for source in (path, raw) if isinstance(raw, dict) else (path,):  # in code, load_config takes a dict
            try:
                load_config(source)
                FUZZ_REPORT["load: ok"] += source is path
            except ConfigError as exc:
                assert exc.fix, exc
                FUZZ_REPORT["load: ConfigError"] += source is path

    check()
    _report("load")
    assert FUZZ_REPORT["load: ok"] > 300 and FUZZ_REPORT["load: ConfigError"] > 300  # both sides exercised


def test_validate_and_generate_agree_and_never_trace_back(env, tmp_path_factory, capsys):
    path = tmp_path_factory.mktemp("fuzz-cli") / "c.json"

    @settings(max_examples=600, **SETTINGS)
    @given(raw=configs(env), style=STYLES)
    def check(raw, style):
        path.write_text(config_text(raw, style))
        note(f"config file ({style}): {path.read_text()[:3000]}")
        v_code, v_err = _run(capsys, "validate", "-c", str(path))
        g_code, g_err = _run(capsys, "generate", "-c", str(path), "-p", "Hi there", "-n", "2", "-q")
        assert v_code in (0, 2) and g_code in (0, 2), (v_code, v_err, g_code, g_err)
        assert "Traceback" not in v_err + g_err
        if v_code == 2:
            assert g_code == 2 and _error(v_err) == _error(g_err), (v_err, g_err)
            FUZZ_REPORT["cli: both exit 2, same message"] += 1
            FUZZ_REPORT["cli:   refused: " + _kind(v_err)] += 1
        elif g_code == 2:
            assert RUNTIME_INPUT.match(_error(g_err)), ("validate passed, generate refused", v_err, g_err)
            FUZZ_REPORT["cli: validate ok, generate: prompt longer than the context"] += 1
        else:
            FUZZ_REPORT["cli: both exit 0 (generated)"] += 1
            KEYS_RUN.update(_keys(raw))

    check()
    _report("cli")
    assert FUZZ_REPORT["cli: both exit 0 (generated)"] > 100 and FUZZ_REPORT["cli: both exit 2, same message"] > 100
