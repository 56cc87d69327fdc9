"""The config: schema errors name the JSON path, structural checks refuse what cannot run, inheritance."""

import json
from pathlib import Path

import jsonschema
import pytest

from lumen_core.config import (
    KVCacheConfig,
    Placement,
    config_from_path_or_model,
    json_path,
    load_config,
    schema,
)
from lumen_core.errors import ConfigError

MINIMAL = {"model": {"path": "x", "compute": "cpu", "store": "ram"}}


def model(**blocks) -> dict:
    """A config whose model block is `path: x` plus `blocks` (underscores become dashes)."""
    return {"model": {"path": "x", **{k.replace("_", "-"): v for k, v in blocks.items()}}}


def error_of(raw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    return info.value


def write(tmp_path: Path, raw, name="lumen.json") -> Path:
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return path


# ---------------------------------------------------------------- the schema itself


def test_schema_is_valid_draft_2020_12_and_closed():
    s = schema()
    jsonschema.Draft202012Validator.check_schema(s)
    assert s["$id"] == "https://lumen.dev/schemas/config.schema.json"
    assert s["additionalProperties"] is False
    objects = [d for d in s["$defs"].values() if d.get("type") == "object"]
    assert objects and all(d.get("additionalProperties") is False for d in objects)


def test_schema_returns_a_copy():
    schema()["title"] = "changed"
    assert schema()["title"] == "Lumen config"


def test_json_path_formats_indices():
    parts = ["model", "hidden-layers", "ranges", 0, "start"]
    assert json_path(parts) == "model.hidden-layers.ranges[0].start"


# ---------------------------------------------------------------- loading


def test_minimal_config_loads():
    config = load_config(MINIMAL)
    assert config.placement("layer", 0) == Placement("cpu", "ram")
    assert config.source == "<dict>"
    assert config.raw == MINIMAL


def test_load_does_not_keep_a_reference_to_the_callers_dict():
    raw = json.loads(json.dumps(MINIMAL))
    config = load_config(raw)
    raw["model"]["store"] = "mmap"
    assert config.placement("input-layer").store == "ram"


def test_file_loads_and_relative_path_resolves_against_its_directory(tmp_path):
    (tmp_path / "configs").mkdir()
    path = write(tmp_path / "configs", {"model": {"path": "../ckpt"}})
    config = load_config(path)
    assert config.model_path.is_absolute()
    assert config.model_path.resolve() == (tmp_path / "ckpt").resolve()
    assert config.source == str(path)


def test_dict_path_resolves_against_base_dir_then_cwd(tmp_path, monkeypatch):
    assert load_config(model(), base_dir=tmp_path).model_path == tmp_path / "x"
    monkeypatch.chdir(tmp_path)
    assert load_config(model()).model_path.resolve() == (tmp_path / "x").resolve()


def test_absolute_and_home_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_config({"model": {"path": "~/m.gguf"}}).model_path == tmp_path / "m.gguf"
    assert load_config({"model": {"path": "/abs/m"}}, base_dir=tmp_path).model_path == Path("/abs/m")


def test_draft_model_path_resolves_like_the_main_one(tmp_path):
    raw = {**model(), "draft": {"model": {"path": "small"}, "num-draft-tokens": 4}}
    assert load_config(raw, base_dir=tmp_path).draft_model_path == tmp_path / "small"
    assert load_config(model()).draft_model_path is None


def test_missing_file(tmp_path):
    err = error_of(tmp_path / "nope.json")
    assert err.path == ""
    assert "file not found" in err.message and "nope.json" in err.message
    assert err.fix


def test_invalid_json_names_line_and_column(tmp_path):
    err = error_of(write(tmp_path, '{\n  "model": {"path": "x",}\n}'))
    assert err.path == ""
    assert "line 2" in err.message and "column" in err.message


def test_nan_is_refused(tmp_path):
    err = error_of(write(tmp_path, '{"model": {"path": "x", "other-parameters": {"temperature": NaN}}}'))
    assert "NaN" in err.message


def test_infinity_from_an_overflowing_literal_is_refused(tmp_path):
    """`1e999` is valid JSON syntax that Python reads as inf: it would pass `minimum: 0` (docs: refused)."""
    err = error_of(write(tmp_path, '{"model": {"path": "x", "other-parameters": {"temperature": 1e999}}}'))
    assert err.path == "model.other-parameters.temperature"
    assert "not a finite number" in err.message and "1e999" in err.message
    err = error_of(write(tmp_path, '{"model": {"path": "x", "other-parameters": {"top-p": -1e400}}}'))
    assert err.path == "model.other-parameters.top-p"


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_numbers_in_a_dict_are_refused(value):
    err = error_of(model(other_parameters={"repetition-penalty": value}))
    assert err.path == "model.other-parameters.repetition-penalty"
    assert "not a finite number" in err.message


def test_json_nested_thousands_deep_is_a_config_error_not_a_recursion_error(tmp_path):
    err = error_of(write(tmp_path, "[" * 5000 + "]" * 5000))
    assert err.path == "" and "nested too deep" in err.message and err.fix
    err = error_of(write(tmp_path, '{"model": {"path": "x", "stop": ' + "[" * 5000 + "]" * 5000 + "}}"))
    assert "nested too deep" in err.message


def test_nesting_past_the_depth_limit_names_the_path(tmp_path):
    """Deep enough for json (100 levels) but past what any key needs: refused by path before the schema errors
    (their messages print the value: json.dumps would recurse through it)."""
    err = error_of(write(tmp_path, '{"model": {"path": "x", "stop": ' + "[" * 100 + "]" * 100 + "}}"))
    assert err.path.startswith("model.stop[0][0]") and "nested more than 32 levels deep" in err.message
    deep: dict = {}
    inner = deep
    for _ in range(5000):  # a dict built in code: deepcopy would recurse too
        inner["a"] = {}
        inner = inner["a"]
    assert "nested more than" in error_of({"model": {"path": "x"}, "x": deep}).message
    cycle: dict = {"path": "x"}
    cycle["self"] = cycle
    assert "nested more than" in error_of({"model": cycle}).message


def test_a_config_as_deep_as_the_schema_goes_still_loads():
    deepest = {"model": {"path": "x"}, "draft": {"num-draft-tokens": 1, "model": {"path": "y", "hidden-layers": {
        "ranges": [{"start": 0, "end": 1, "experts": {"compute": "cpu", "store": "ram"}}]}}}}
    assert load_config(deepest).draft_model_path is not None


def test_lone_surrogates_and_nul_in_file_names_are_refused(tmp_path):
    err = error_of(write(tmp_path, '{"model": {"path": "a\\ud800b"}}'))
    assert err.path == "model.path" and "surrogate" in err.message
    err = error_of(write(tmp_path, '{"model": {"path": "x", "\\udc00": 1}}'))
    assert err.path == "model" and "surrogate" in err.message
    for key in ("path", "chat-template"):
        err = error_of({"model": {"path": "x", key: "a\0b"}})
        assert err.path == f"model.{key}" and "NUL" in err.message
    assert load_config(model(other_parameters={"stop": ["\U0001f600", "\0"]}))  # pairs and NUL elsewhere: text


def test_what_json_cannot_hold_in_a_dict_is_a_config_error():
    assert error_of({"model": {"path": "x", 1: "y"}}).message == "key 1 is not a string"
    err = error_of({"model": {"path": Path("x")}})  # printed with repr, not a TypeError from json.dumps
    assert err.path == "model.path" and "PosixPath" in err.message or "WindowsPath" in err.message


def test_a_config_name_too_long_for_the_system_is_a_config_error():
    name = "c" * 5000 + ".json"
    err = error_of(name)
    assert err.path == "" and "cannot read" in err.message and "too long" in err.message
    assert "cannot read" in pytest.raises(ConfigError, config_from_path_or_model, name).value.message


@pytest.mark.parametrize(("raw", "where"), [
    ({"model": {"path": "~lumen-no-such-user/x"}}, "model.path"),
    ({"model": {"path": "x", "chat-template": "~lumen-no-such-user/t.jinja"}}, "model.chat-template"),
    ({"model": {"path": "x"}, "draft": {"model": {"path": "~lumen-no-such-user/d"}, "num-draft-tokens": 1}},
     "draft.model.path"),
])
def test_a_home_of_no_such_user_is_a_config_error(raw, where):
    """Path.expanduser raises RuntimeError for ~name of an unknown user: refused by path at load time."""
    err = error_of(raw)
    assert err.path == where and "no such user" in err.message and "~/" in err.fix


def test_a_config_file_under_the_home_of_no_such_user():
    err = error_of("~lumen-no-such-user/lumen.json")
    assert err.path == "" and "no such user" in err.message


def test_unreadable_file_is_a_config_error(tmp_path, monkeypatch):
    path = write(tmp_path, MINIMAL)
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "Permission "
                                                                                                     "denied")))
    err = error_of(path)
    assert "Permission denied" in err.message and err.fix


def test_duplicate_keys_are_refused(tmp_path):
    err = error_of(write(tmp_path, '{"model": {"path": "x", "store": "ram", "store": "vram"}}'))
    assert "duplicate key 'store'" in err.message


# ---------------------------------------------------------------- schema errors


def test_unknown_key_at_top_level():
    err = error_of({**MINIMAL, "modle": {}})
    assert err.path == "modle"
    assert "unknown key 'modle'" in err.message
    assert "server-parameters" in err.message  # the allowed keys are listed
    assert err.fix == "did you mean 'model'?"


def test_unknown_key_deep_inside_ranges():
    ranges = [{"start": 0, "end": 2}, {"start": 2, "end": 4, "stor": "ram"}]
    err = error_of(model(hidden_layers={"ranges": ranges}))
    assert err.path == "model.hidden-layers.ranges[1].stor"
    assert "allowed keys: compute, end, experts, start, store" in err.message


def test_bad_store_enum_lists_allowed_values():
    err = error_of(model(store="disk"))
    assert err.path == "model.store"
    assert "vram, gpu, ram, mmap" in err.message and '"disk"' in err.message


def test_bad_kv_type_enum_deep():
    err = error_of(model(hidden_layers={"kv-cache": {"type-k": "q4"}}))
    assert err.path == "model.hidden-layers.kv-cache.type-k"
    assert "f32, f16, bf16, fp8" in err.message


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:x", "CPU", "cuda:0 ", " cpu", "cpu\n", "cuda:0\n",
                                    "cuda:\u0663", "cuda:\uff11", "cpu\n\n", "cuda:0\r"])
def test_bad_compute_pattern(device):
    """Python's `$` matches before a final newline and `\\d` takes any Unicode digit; the schema means ECMA's
    `$` (end of string) and ASCII digits, and so does the validator."""
    err = error_of(model(input_layer={"compute": device}))
    assert err.path == "model.input-layer.compute"
    assert "not a compute device" in err.message
    assert "cuda:N" in err.fix


@pytest.mark.parametrize("device", ["cpu", "cuda:0", "cuda:12", "wgpu:1"])
def test_good_compute_devices(device):
    assert load_config(model(compute=device, store="ram")).placement("layer").compute == device


def test_wrong_type_names_expected_type_and_value():
    err = error_of(model(hidden_layers={"kv-cache": {"context-size": "2048"}}))
    assert err.path == "model.hidden-layers.kv-cache.context-size"
    assert err.message == 'expected integer, got string "2048"'


def _schema_leaves(node: dict, parts: tuple, defs: dict):
    """(path parts, leaf schema) of every scalar key of the schema; array items are at index 0."""
    if "$ref" in node:
        node = {**defs[node["$ref"].split("/")[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
    if node.get("type") == "object":
        for key, sub in node["properties"].items():
            yield from _schema_leaves(sub, parts + (key,), defs)
    elif node.get("type") == "array" and node["items"].get("type") != "string":
        yield from _schema_leaves(node["items"], parts + (0,), defs)
    else:
        yield parts, node


def _every_integer() -> dict:
    """A config that loads with every integer key of the schema set: those of a model block by hand (start < end),
    any other (server-parameters, a key added later) at its schema minimum, else 1."""
    model = {"path": "x", "hidden-layers": {"experts": {"cache": 4}, "kv-cache": {"context-size": 64},
                                            "ranges": [{"start": 0, "end": 2, "experts": {"cache": 2}}]},
             "other-parameters": {"top-k": 5, "seed": 1, "max-tokens": 5}}
    raw = {"model": model, "draft": {"model": json.loads(json.dumps(model)), "num-draft-tokens": 2}}
    s = schema()
    for parts, leaf in _schema_leaves(s, (), s["$defs"]):
        if leaf.get("type") == "integer":
            node = raw
            for p in parts[:-1]:
                node = node[p] if isinstance(p, int) else node.setdefault(p, {})  # ranges[0] exists
            node.setdefault(parts[-1], max(leaf.get("minimum", 1), 1))
    return raw


EVERY_INTEGER = _every_integer()


def _get(raw, parts):
    for p in parts:
        raw = raw[p]
    return raw


def _set(raw, parts, value):
    _get(raw, parts[:-1])[parts[-1]] = value


def _leaves(kind: str) -> list[tuple]:
    s = schema()
    return [parts for parts, leaf in _schema_leaves(s, (), s["$defs"]) if leaf.get("type") == kind]


def test_every_integer_key_refuses_a_float_even_with_a_zero_fraction():
    """jsonschema counts 5.0 as an integer; the engine needs an int (4096.0 as context-size crashed attention
    with a TypeError). Walks the whole schema: each integer key, given its valid value as a float, is refused at
    its own path, naming the integer to write."""
    ints = _leaves("integer")
    assert len(ints) >= 18 and set(ints) == {p for p in ints if isinstance(_get(EVERY_INTEGER, p), int)}
    load_config(EVERY_INTEGER)
    for parts in ints:
        raw = json.loads(json.dumps(EVERY_INTEGER))
        good = _get(raw, parts)
        _set(raw, parts, float(good))
        err = error_of(raw)
        assert err.path == json_path(parts), parts
        assert err.message == f"expected integer, got number {float(good)}" and str(good) in err.fix


def test_integers_written_with_an_exponent_are_refused_from_a_file(tmp_path):
    err = error_of(write(tmp_path, '{"model": {"path": "x", "other-parameters": {"max-tokens": 5e0}}}'))
    assert err.path == "model.other-parameters.max-tokens" and "got number 5.0" in err.message


def test_every_pattern_key_matches_the_whole_string():
    """Each compute key of the schema (found by walking it: 8 in a model block, twice, vision's, audio's and the flat
    draft's) takes `cpu` and refuses `cpu` plus a newline at its own path."""
    s = schema()
    patterned = [parts for parts, leaf in _schema_leaves(s, (), s["$defs"]) if "pattern" in leaf]
    assert len(patterned) == 19 and all(p[-1] == "compute" for p in patterned)
    base = {**json.loads(json.dumps(EVERY_INTEGER)), "vision": {}}
    for block in (base["model"], base["draft"]["model"]):
        block.update({"input-layer": {}, "output-layer": {}})
    for parts in patterned:
        for device, ok in (("cpu", True), ("cpu\n", False)):
            raw = json.loads(json.dumps(base))
            if parts == ("draft", "compute"):  # LumenLLM's flat draft form, which cannot sit beside draft.model
                raw["draft"] = {"path": "y"}
            if parts[0] == "audio":
                raw["audio"] = {}
            if parts[-2] == "attention":  # model.attention is not in the base
                _get(raw, parts[:-2]).setdefault("attention", {})
            _set(raw, parts, device)
            if ok:
                assert load_config(raw).placement("layer").compute == "cpu"
                continue
            err = error_of(raw)
            assert err.path == json_path(parts) and "not a compute device" in err.message, parts


def test_boolean_is_not_an_integer():
    err = error_of(model(other_parameters={"max-tokens": True}))
    assert err.path == "model.other-parameters.max-tokens"
    assert "got boolean" in err.message


def test_out_of_bounds_names_the_bound():
    err = error_of(model(other_parameters={"top-p": 0}))
    assert err.path == "model.other-parameters.top-p"
    assert err.message == "must be > 0, got 0"


def test_port_range():
    err = error_of({**MINIMAL, "server-parameters": {"port": 70000}})
    assert err.path == "server-parameters.port"
    assert "<= 65535" in err.message


def test_missing_model():
    err = error_of({"server-parameters": {"port": 8080}})
    assert err.path == "model"
    assert err.message == "missing required key 'model'"


def test_missing_path():
    err = error_of({"model": {"compute": "cpu"}})
    assert err.path == "model.path"
    assert "missing required key 'path'" in err.message


def test_root_must_be_an_object(tmp_path):
    err = error_of(write(tmp_path, [MINIMAL]))
    assert err.path == ""
    assert "expected object, got array" in err.message


def test_draft_num_draft_tokens_defaults_to_lumenllms_4():
    assert load_config({**MINIMAL, "draft": {"model": {"path": "y"}}}).raw["draft"]["num-draft-tokens"] == 4
    err = error_of({**MINIMAL, "draft": {"model": {"path": "y"}, "num-draft-tokens": 0}})
    assert err.path == "draft.num-draft-tokens"


# ---------------------------------------------------------------- structural checks


def test_vram_on_cpu_at_model_level():
    err = error_of(model(compute="cpu", store="vram"))
    assert err.path == "model.store"
    assert "GPU" in err.message and err.fix


def test_vram_with_default_compute_blames_the_store():
    assert error_of(model(store="vram")).path == "model.store"


def test_vram_inherited_by_a_cpu_block_blames_the_cpu_compute():
    err = error_of(model(compute="cuda:0", store="vram", output_layer={"compute": "cpu"}))
    assert err.path == "model.output-layer.compute"
    assert "store vram from model.store" in err.message


def test_vram_in_a_range_on_cpu_layers():
    err = error_of(model(hidden_layers={"ranges": [{"start": 0, "end": 2, "store": "vram"}]}))
    assert err.path == "model.hidden-layers.ranges[0].store"


def test_experts_on_cpu_with_vram_store():
    err = error_of(model(compute="cuda:0", store="vram", hidden_layers={"experts": {"compute": "cpu"}}))
    assert err.path == "model.hidden-layers.experts.compute"
    assert "experts" in err.message
    assert "ram or mmap" in err.fix


def test_experts_on_cpu_with_host_store_is_fine():
    experts = {"compute": "cpu", "store": "mmap"}
    raw = model(compute="cuda:0", store="vram", hidden_layers={"experts": experts})
    assert load_config(raw).placement("experts", 3) == Placement("cpu", "mmap")


def test_range_experts_on_cpu_inheriting_vram_from_the_range():
    ranges = [{"start": 0, "end": 4, "compute": "cuda:0", "store": "vram", "experts": {"compute": "cpu"}}]
    err = error_of(model(hidden_layers={"ranges": ranges}))
    assert err.path == "model.hidden-layers.ranges[0].experts.compute"


def test_vision_and_draft_placements_are_checked():
    assert error_of({**MINIMAL, "vision": {"store": "vram"}}).path == "vision.store"
    draft = {"model": {"path": "y", "input-layer": {"store": "vram"}}, "num-draft-tokens": 2}
    assert error_of({**MINIMAL, "draft": draft}).path == "draft.model.input-layer.store"


def test_overlapping_ranges_name_both_indices():
    ranges = [{"start": 0, "end": 4}, {"start": 8, "end": 10}, {"start": 3, "end": 6}]
    err = error_of(model(hidden_layers={"ranges": ranges}))
    assert err.path == "model.hidden-layers.ranges[2]"
    # In exclusive terms, as written and as layers: the two ranges share layer 3.
    assert err.message == ("ranges[2], layers 3-5 (start 3, end 6), overlaps ranges[0], layers 0-3 (start 0, end 4), "
                           "on layer 3 (end is exclusive)")


def test_start_after_end():
    err = error_of(model(hidden_layers={"ranges": [{"start": 5, "end": 4}]}))
    assert err.path == "model.hidden-layers.ranges[0].start"
    assert "5" in err.message and "4" in err.message


def test_single_layer_range_is_fine():
    config = load_config(model(hidden_layers={"ranges": [{"start": 2, "end": 3, "store": "mmap"}]}))
    assert config.ranges()[0]["end"] == 3
    assert [config.placement("layer", n).store for n in (1, 2, 3)] == ["ram", "mmap", "ram"]


def test_range_end_past_the_last_layer():
    config = load_config(model(hidden_layers={"ranges": [{"start": 0, "end": 4}, {"start": 4, "end": 9}]}))
    config.check_ranges(9)  # layers 0-8, end 9 == the layer count: fine
    with pytest.raises(ConfigError) as info:
        config.check_ranges(8)
    assert info.value.path == "model.hidden-layers.ranges[1].end"
    assert "end 9 is past the model's layers: the model has 8 layers (0-7)" in info.value.message
    assert "end is exclusive" in info.value.message and info.value.fix == "set end to at most 8"


# ---------------------------------------------------------------- ranges: end is exclusive (LumenLLM's meaning)


def test_range_end_is_exclusive():
    hidden = {"compute": "cpu", "ranges": [{"start": 2, "end": 5, "compute": "cuda:0"}]}
    config = load_config(model(hidden_layers=hidden))
    assert [config.placement("layer", n).compute for n in range(7)] == ["cpu"] * 2 + ["cuda:0"] * 3 + ["cpu"] * 2
    assert config.placement_path("layer", 4) == "model.hidden-layers.ranges[0]"
    assert config.placement_path("layer", 5) == "model.hidden-layers"


def test_lumenllm_split_of_48_layers():
    """LumenLLM's guide (docs/CONFIG.md): {start 0, end 24} and {start 24, end 48} split 48 layers in two halves."""
    ranges = [{"start": 0, "end": 24, "store": "vram", "compute": "cuda:0"},
              {"start": 24, "end": 48, "store": "ram", "compute": "cpu"}]
    config = load_config(model(hidden_layers={"compute": "cuda:0", "store": "ram", "ranges": ranges}))
    config.check_ranges(48)  # end 48 == the layer count
    assert config.range_notes(48) == []
    places = [config.placement("layer", n) for n in range(48)]
    assert places[:24] == [Placement("cuda:0", "vram")] * 24 and places[24:] == [Placement("cpu", "ram")] * 24
    assert [config.placement_path("layer", n) for n in (0, 23, 24, 47)] == [
        "model.hidden-layers.ranges[0]", "model.hidden-layers.ranges[0]",
        "model.hidden-layers.ranges[1]", "model.hidden-layers.ranges[1]"]


def test_empty_range_is_refused_naming_end():
    err = error_of(model(hidden_layers={"ranges": [{"start": 0, "end": 2}, {"start": 3, "end": 3}]}))
    assert err.path == "model.hidden-layers.ranges[1].end"
    assert "the range is empty" in err.message and "end is exclusive" in err.message
    assert err.fix == "set end to 4 for layer 3 alone, or remove the range"


def test_ranges_may_touch_but_not_overlap():
    load_config(model(hidden_layers={"ranges": [{"start": 0, "end": 24}, {"start": 24, "end": 48}]}))
    err = error_of(model(hidden_layers={"ranges": [{"start": 0, "end": 24}, {"start": 23, "end": 48}]}))
    assert err.path == "model.hidden-layers.ranges[1]"
    assert err.message == ("ranges[1], layers 23-47 (start 23, end 48), overlaps ranges[0], layers 0-23 "
                           "(start 0, end 24), on layer 23 (end is exclusive)")
    err = error_of(model(hidden_layers={"ranges": [{"start": 0, "end": 30}, {"start": 20, "end": 48}]}))
    assert "on layers 20-29 (end is exclusive)" in err.message


def test_layers_outside_every_range_use_hidden_layers():
    ranges = [{"start": 0, "end": 10, "compute": "cpu", "store": "mmap"},
              {"start": 20, "end": 30, "compute": "cpu", "store": "mmap"}]
    config = load_config(model(hidden_layers={"compute": "cuda:0", "store": "vram", "ranges": ranges}))
    assert config.placement("layer", 15) == Placement("cuda:0", "vram")
    assert config.range_notes(48) == []  # a gap of ten layers is no slip of an inclusive end


def test_inclusive_looking_ends_get_a_note():
    """{0, 23}, {24, 47} on 48 layers reads as an inclusive end: layers 23 and 47 are in no range. Not refused (a
    gap is legitimate), but each such layer is named with the fix."""
    ranges = [{"start": 0, "end": 23, "compute": "cpu", "store": "ram"},
              {"start": 24, "end": 47, "compute": "cpu", "store": "mmap"}]
    config = load_config(model(hidden_layers={"compute": "cuda:0", "store": "vram", "ranges": ranges}))
    config.check_ranges(48)
    assert config.placement("layer", 23) == Placement("cuda:0", "vram")
    assert config.range_notes(48) == [
        "config model.hidden-layers.ranges[0].end: ranges end is exclusive (LumenLLM's meaning): layer 23 is in no "
        "range and uses hidden-layers' placement; if you meant it inclusive, set end to 24",
        "config model.hidden-layers.ranges[1].end: ranges end is exclusive (LumenLLM's meaning): layer 47 is in no "
        "range and uses hidden-layers' placement; if you meant it inclusive, set end to 48"]
    # Ranges listed out of order: the gap is between consecutive layers, whatever the list order.
    config = load_config(model(hidden_layers={"compute": "cuda:0", "store": "vram", "ranges": ranges[::-1]}))
    assert [n.split(":")[0] for n in config.range_notes(49)] == ["config model.hidden-layers.ranges[1].end"]


def test_the_schema_says_end_is_exclusive():
    rng = schema()["$defs"]["range"]
    assert "exclusive" in rng["properties"]["end"]["description"] and "exclusive" in rng["description"]
    assert "inclusive" not in json.dumps(rng)


def test_no_note_where_the_gap_layer_would_be_placed_the_same():
    # Layer 23 uses hidden-layers' placement, which is ranges[0]'s too: inclusive or not, nothing differs.
    ranges = [{"start": 0, "end": 23, "compute": "cuda:0"}, {"start": 24, "end": 48, "compute": "cpu"}]
    config = load_config(model(hidden_layers={"compute": "cuda:0", "ranges": ranges}))
    assert config.range_notes(48) == []
    # ...but its experts would move: noted.
    ranges[0]["experts"] = {"compute": "cpu"}
    config = load_config(model(hidden_layers={"compute": "cuda:0", "ranges": ranges}))
    assert [n.split(":")[0] for n in config.range_notes(48)] == ["config model.hidden-layers.ranges[0].end"]


def test_fp8_attention_without_fp8_kv():
    kv = {"kv-cache": {"type-k": "fp8", "type-v": "f16"}}
    err = error_of(model(attention={"compute-quantization": "fp8"}, hidden_layers=kv))
    assert err.path == "model.attention.compute-quantization"
    assert "type-v is f16" in err.message


def test_fp8_attention_with_fp8_kv_loads():
    kv = {"kv-cache": {"type-k": "fp8", "type-v": "fp8"}}
    config = load_config(model(attention={"compute-quantization": "fp8"}, hidden_layers=kv))
    assert config.kv_cache().type_v == "fp8"


# ---------------------------------------------------------------- inheritance


def test_defaults_are_cpu_and_ram():
    config = load_config(model())
    for component in ("input-layer", "output-layer", "layer", "experts", "vision"):
        assert config.placement(component, 0) == Placement("cpu", "ram")
    assert config.placement_path("layer", 0) == "model"


def test_input_layer_inherits_model_and_overrides_one_key():
    config = load_config(model(compute="cuda:1", store="vram", input_layer={"store": "ram"}))
    assert config.placement("input-layer") == Placement("cuda:1", "ram")
    assert config.placement("output-layer") == Placement("cuda:1", "vram")
    assert config.placement_path("input-layer") == "model.input-layer"
    assert config.placement_path("output-layer") == "model"


def test_range_overrides_hidden_layers_only_inside_it():
    hidden = {"compute": "cuda:0", "store": "mmap", "ranges": [{"start": 2, "end": 5, "store": "vram"}]}
    config = load_config(model(hidden_layers=hidden))
    assert config.placement("layer", 1) == Placement("cuda:0", "mmap")
    assert config.placement("layer", 2) == Placement("cuda:0", "vram")
    assert config.placement("layer", 4) == Placement("cuda:0", "vram")
    assert config.placement("layer", 5) == Placement("cuda:0", "mmap")
    assert config.placement_path("layer", 3) == "model.hidden-layers.ranges[0]"
    assert config.placement_path("layer", 5) == "model.hidden-layers"


def test_experts_follow_their_layer_when_nothing_is_said():
    hidden = {"ranges": [{"start": 0, "end": 2, "compute": "wgpu:0", "store": "vram"}]}
    config = load_config(model(hidden_layers=hidden))
    assert config.placement("experts", 0) == Placement("wgpu:0", "vram")
    assert config.placement("experts", 2) == Placement("cpu", "ram")


def test_experts_precedence_more_specific_wins():
    ranges = [{"start": 0, "end": 2, "compute": "cuda:0", "store": "vram"},
              {"start": 2, "end": 4, "compute": "cuda:0", "store": "vram", "experts": {"store": "ram"}}]
    hidden = {"experts": {"compute": "cpu", "store": "mmap"}, "ranges": ranges}
    config = load_config(model(compute="cuda:1", store="vram", hidden_layers=hidden))
    # hidden-layers.experts beats the range's own compute/store...
    assert config.placement("experts", 0) == Placement("cpu", "mmap")
    assert config.placement_path("experts", 0) == "model.hidden-layers.experts"
    # ...and range.experts beats hidden-layers.experts, key by key.
    assert config.placement("experts", 2) == Placement("cpu", "ram")
    assert config.placement_path("experts", 2) == "model.hidden-layers.ranges[1].experts"
    # Outside every range: hidden-layers.experts over hidden-layers.
    assert config.placement("experts", 7) == Placement("cpu", "mmap")
    assert config.placement("layer", 7) == Placement("cuda:1", "vram")


def test_vision_inherits_model():
    config = load_config({**model(compute="cuda:0", store="vram"), "vision": {"store": "ram"}})
    assert config.placement("vision") == Placement("cuda:0", "ram")


def test_placement_properties():
    place = Placement("cuda:3", "vram")
    assert (place.backend, place.device) == ("cuda", "cuda:3")
    assert Placement("cpu", "ram").backend == "cpu"


def test_unknown_component():
    with pytest.raises(ValueError, match="unknown component"):
        load_config(MINIMAL).placement("mlp")


# ---------------------------------------------------------------- accessors


def test_ranges_carry_their_index_and_are_copies():
    config = load_config(model(hidden_layers={"ranges": [{"start": 0, "end": 2}, {"start": 5, "end": 7}]}))
    ranges = config.ranges()
    assert [(r["index"], r["start"]) for r in ranges] == [(0, 0), (1, 5)]
    ranges[0]["start"] = 99
    assert config.ranges()[0]["start"] == 0


def test_kv_cache_defaults_and_values():
    assert load_config(MINIMAL).kv_cache() == KVCacheConfig(None, None, "f32", "f32", False)
    kv = {"context-size": 2048, "store": "ram", "type-k": "f16", "type-v": "bf16",
          "allow-beyond-trained-context": True}
    got = load_config(model(hidden_layers={"kv-cache": kv})).kv_cache()
    assert got == KVCacheConfig(2048, "ram", "f16", "bf16", True)
    err = error_of(model(hidden_layers={"kv-cache": {"allow-beyond-trained-context": 1}}))
    assert err.message == "expected boolean, got integer 1"


def test_seed_below_zero_is_refused_by_the_schema():
    err = error_of(model(other_parameters={"seed": -1}))
    assert err.path == "model.other-parameters.seed" and err.message == "must be >= 0, got -1"


def test_other_parameters_go_through_the_samplers_own_check(monkeypatch):
    """One truth: the config runs SamplingParams.validate() (what generate runs), so whatever it refuses is refused
    at load time, in its words, at the key's path; values it refuses only together blame the block."""
    from lumen_core.errors import InputError
    from lumen_core.sampling import SamplingParams

    class Named(InputError):  # as SamplingError names its field
        field = "min_p"

    def stand_in(self):
        if self.top_p == 0.5:
            raise InputError("sampling top_p=0.5 is refused by the stand-in")
        if self.top_k == 7 and self.temperature == 0:
            raise InputError("top_k 7 needs a temperature")
        if self.min_p == 0.25 and self.seed == 3:
            raise Named("min_p 0.25 needs another seed")
        return self

    monkeypatch.setattr(SamplingParams, "validate", stand_in)
    err = error_of(model(other_parameters={"temperature": 1, "top-p": 0.5, "max-tokens": 3}))
    assert err.path == "model.other-parameters.top-p"
    assert err.message == "sampling top_p=0.5 is refused by the stand-in"
    assert "model.other-parameters.top-p" in err.fix
    err = error_of(model(other_parameters={"temperature": 0, "top-k": 7}))
    assert err.path == "model.other-parameters" and err.message == "top_k 7 needs a temperature"
    err = error_of(model(other_parameters={"seed": 3, "min-p": 0.25}))  # refused together, the error names min_p
    assert err.path == "model.other-parameters.min-p" and err.message == "min_p 0.25 needs another seed"
    draft = {**model(), "draft": {"model": {"path": "y", "other-parameters": {"top-p": 0.5}}, "num-draft-tokens": 1}}
    assert error_of(draft).path == "draft.model.other-parameters.top-p"
    assert load_config(model(other_parameters={"temperature": 0, "top-k": 6}))


def test_sampling_defaults_use_python_names_and_only_present_keys():
    params = {"temperature": 0.7, "top-k": 20, "repetition-penalty": 1.1, "stop": ["</s>"], "max-tokens": 5}
    got = load_config(model(other_parameters=params)).sampling_defaults()
    assert got == {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.1, "stop": ["</s>"],
                   "max_tokens": 5}
    assert load_config(MINIMAL).sampling_defaults() == {}


def test_a_key_serve_would_refuse_is_refused_at_load_for_every_command():
    """Config.server_parameters() (serve's check of its block) runs in load_config: validate and generate refuse a
    blank API key too, as they refuse a port out of range."""
    err = error_of({**MINIMAL, "server-parameters": {"api-keys": ["good", "  "]}})
    assert err.path == "server-parameters.api-keys[1]"


def test_server_parameters():
    raw = {**MINIMAL, "server-parameters": {"host": "0.0.0.0", "port": 8080, "api-keys": ["k"]}}
    assert load_config(raw).server_parameters() == {"host": "0.0.0.0", "port": 8080, "api_keys": ["k"]}
    assert load_config(MINIMAL).server_parameters() == {}


def test_requested_features():
    assert load_config(MINIMAL).requested_features() == []
    assert load_config(model(attention={"compute-quantization": "none"})).requested_features() == []
    raw = {**model(attention={"compute-quantization": "fp8"},
                   hidden_layers={"kv-cache": {"store": "ram", "type-k": "fp8", "type-v": "fp8"}}),
           "vision": {}, "draft": {"model": {"path": "y"}, "num-draft-tokens": 3}}
    assert load_config(raw).requested_features() == [  # a draft (speculative decoding) is planned: issue 20
        ("model.attention.compute-quantization", "fp8 attention")]


# ---------------------------------------------------------------- config_from_path_or_model


def test_checkpoint_dir_gets_the_minimal_config(tmp_path):
    config = config_from_path_or_model(str(tmp_path))
    assert config.raw == {"model": {"path": str(tmp_path), "compute": "cpu", "store": "ram"}}
    assert config.model_path == tmp_path


def test_gguf_gets_the_minimal_config_even_before_it_exists(tmp_path):
    config = config_from_path_or_model(tmp_path / "m.gguf")
    assert config.model_path == tmp_path / "m.gguf"
    assert config.placement("layer", 0) == Placement("cpu", "ram")


def test_json_file_is_loaded_as_a_config(tmp_path):
    path = write(tmp_path, model(compute="cuda:0", store="mmap"))
    assert config_from_path_or_model(path).placement("output-layer") == Placement("cuda:0", "mmap")
    with pytest.raises(ConfigError, match="file not found"):
        config_from_path_or_model(tmp_path / "missing.json")
