"""Speculative decoding's config, plan and options (issue 20): the three forms of the `draft` block, the draft model
planned beside the main one (rows `draft.*`, one capacity check over both), the MTP head (`draft.mtp`), the
`Backend.speculative` refusal, the tokenizer check, and `--draft-model` / `--draft-tokens` / `--mtp`."""

from __future__ import annotations

import json

import pytest

from lumen_core import plan as plan_mod
from lumen_core.checkpoint import open_checkpoint
from lumen_core.config import DraftSpec, Placement, load_config
from lumen_core.draft import check_draft_tokenizer
from lumen_core.engine import prepare
from lumen_core.errors import ConfigError, InputError, PlanError
from lumen_core.plugins import get_registry
from lumen_core.tokenizer import Tokenizer

MODEL = {"path": "m", "compute": "cpu", "store": "mmap"}


def refusal(raw: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    return info.value


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from lumen_core.cli import main

    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- the config


def test_the_draft_model_forms_read_as_one_draftspec(tmp_path):
    """LumenLLM's flat form (compute/store inherited from model), Lumen's draft.model and mtp: false beside a path
    are the same draft: 3 tokens, a draft model whose Config places it as model does, its path relative to the
    config's directory."""
    forms = [{"path": "d", "num-draft-tokens": 3},
             {"model": {"path": "d", "compute": "cpu", "store": "mmap"}, "num-draft-tokens": 3},
             {"mtp": False, "path": "d", "num-draft-tokens": 3}]
    specs = [load_config({"model": MODEL, "draft": form}, base_dir=tmp_path).draft() for form in forms]
    for spec in specs:
        assert (spec.tokens, spec.mtp) == (3, False)
        assert spec.config.raw == {"model": {"path": "d", "compute": "cpu", "store": "mmap"}}
        assert spec.config.model_path == tmp_path / "d"
        assert spec.config.placement("layer", 0) == Placement("cpu", "mmap")
    assert load_config({"model": MODEL, "draft": {"path": "d"}}).draft().tokens == 4  # LumenLLM's default
    assert load_config({"model": MODEL}).draft() is None


def test_the_mtp_form_reads_as_a_draftspec_without_a_draft_model():
    config = load_config({"model": MODEL, "draft": {"mtp": True, "num-draft-tokens": 2}})
    assert config.draft() == DraftSpec(tokens=2, mtp=True, config=None)
    assert config.raw["draft"] == {"mtp": True, "num-draft-tokens": 2}
    assert config.draft_model_path is None and config.requested_features() == []
    assert load_config({"model": MODEL, "draft": {"mtp": True}}).draft().tokens == 4
    assert config.placement("mtp") == config.placement("output-layer")  # the head reads the lm_head there


def test_a_draft_file_resolves_its_path_against_the_files_directory(write_config, tmp_path):
    path = write_config({"model": {"path": "m"}, "draft": {"model": {"path": "../drafts/d"}}})
    spec = load_config(path).draft()
    assert spec.config.model_path == tmp_path / ".." / "drafts" / "d"
    assert spec.config.source == f"{path} (draft)"


@pytest.mark.parametrize("draft, path, words", [
    ({"mtp": True, "path": "d"}, "draft.mtp", "draft.path also names a draft model"),
    ({"mtp": True, "model": {"path": "d"}}, "draft.mtp", "draft.model also names a draft model"),
    ({"mtp": True, "compute": "cpu"}, "draft.mtp", "draft.compute also names"),
    ({"mtp": False}, "draft.path", "missing the draft checkpoint"),
    ({"mtp": False, "num-draft-tokens": 2}, "draft.path", "'mtp': true"),
    ({"mtp": 1}, "draft.mtp", "expected boolean"),
    ({"mtp": True, "num-draft-tokens": 0}, "draft.num-draft-tokens", ">= 1"),
])
def test_bad_draft_blocks_are_refused_naming_the_key(draft, path, words):
    err = refusal({"model": MODEL, "draft": draft})
    assert err.path == path and words in err.message and err.fix


def test_with_draft_applies_the_options_and_checks_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = load_config({"model": MODEL, "draft": {"mtp": True, "num-draft-tokens": 6}})
    assert base.with_draft() is base
    flat = base.with_draft("small")  # relative to the working directory; the config's tokens kept
    assert flat.raw["draft"] == {"model": {"path": str(tmp_path / "small"), "compute": "cpu", "store": "mmap"},
                                 "num-draft-tokens": 6}
    assert flat.draft().config.model_path == tmp_path / "small"
    assert base.with_draft("Org/Draft").raw["draft"]["model"]["path"] == "Org/Draft"  # a model id stays an id
    assert base.with_draft(tokens=2).draft() == DraftSpec(2, True, None)
    assert flat.with_draft(mtp=True).draft() == DraftSpec(6, True, None)
    assert base.raw["draft"] == {"mtp": True, "num-draft-tokens": 6}  # the original is left as it was
    plain = load_config({"model": MODEL})
    with pytest.raises(InputError, match="--draft-tokens 3 needs a draft: add --draft-model PATH or --mtp"):
        plain.with_draft(tokens=3)
    with pytest.raises(InputError, match="not both"):
        plain.with_draft("d", mtp=True)
    with pytest.raises(InputError, match="--draft-model: the path is empty"):
        plain.with_draft(" ")


# ---------------------------------------------------------------- the plan with a draft model


def labels(plan) -> list[str]:
    return [e.component for e in plan.entries]


def test_a_draft_model_is_planned_at_the_main_context_and_merged(tiny_checkpoint):
    main, draft = str(tiny_checkpoint("qwen3_5")), str(tiny_checkpoint("qwen3_5", num_hidden_layers=2))
    alone = prepare({"model": {"path": main, "hidden-layers": {"kv-cache": {"context-size": 96}}}})[3]
    config = load_config({"model": {"path": main, "hidden-layers": {"kv-cache": {"context-size": 96}}},
                          "draft": {"model": {"path": draft, "store": "mmap",
                                              "hidden-layers": {"kv-cache": {"context-size": 32}}},
                                    "num-draft-tokens": 3}})
    _, _, _, plan, resolved = prepare(config)
    drafted = [e for e in plan.entries if e.component.startswith("draft.")]
    assert labels(plan)[:len(alone.entries)] == labels(alone)  # the main rows first, as without a draft
    assert [e.component for e in drafted] == ["draft.input-layer", "draft.layers.0", "draft.cache.layers.0",
                                              "draft.layers.1", "draft.cache.layers.1", "draft.output-layer"]
    assert {e.store for e in drafted if e.kind == "weights"} == {"mmap"}
    # both models in the pools: the draft's weights in the page cache, its caches in host RAM beside the main's
    pools = plan.pools()
    assert pools["mmap (page cache)"] == sum(e.nbytes for e in drafted if e.kind == "weights") > 0
    assert pools["host RAM"] == alone.pools()["host RAM"] + sum(e.nbytes for e in drafted if e.kind == "cache")
    draft_config = resolved["draft_config"]
    assert draft_config.kv_cache().context_size == plan.context_size == 96  # not the draft's own 32
    assert str(draft_config.model_path) == draft and draft_config.placement("layer", 1) == Placement("cpu", "mmap")
    assert prepare(draft_config)[3].entries == [  # what the engine loads the draft from plans exactly these rows
        plan_mod.PlanEntry(**{**e.__dict__, "component": e.component.removeprefix("draft.")}) for e in drafted]
    assert plan.notes == [
        "speculative decoding: the draft model " + draft + " proposes 3 token(s) per verification step",
        "draft: config draft.model.hidden-layers.kv-cache.context-size 32 is not used: the draft holds the main "
        "model's context of 96 tokens (as many as the main model)"]
    assert resolved["draft_config"] is not None and prepare({"model": {"path": main}})[4]["draft_config"] is None


def test_a_draft_trained_on_fewer_tokens_than_the_context_is_refused(tiny_checkpoint):
    main = str(tiny_checkpoint("qwen3_5"))
    short = str(tiny_checkpoint("qwen3_5", num_hidden_layers=2, max_position_embeddings=64))
    kv = {"context-size": 128}
    with pytest.raises(ConfigError) as info:
        prepare({"model": {"path": main, "hidden-layers": {"kv-cache": kv}}, "draft": {"path": short}})
    err = info.value
    assert err.path == "model.hidden-layers.kv-cache.context-size"
    assert "beyond the draft model's trained context of 64 tokens" in err.message and short in err.message
    assert "at most 64" in err.fix and "allow-beyond-trained-context: true" in err.fix
    allowed = {**kv, "allow-beyond-trained-context": True}
    _, _, _, plan, resolved = prepare({"model": {"path": main, "hidden-layers": {"kv-cache": allowed}},
                                       "draft": {"path": short}})
    draft_kv = resolved["draft_config"].kv_cache()
    assert (draft_kv.context_size, draft_kv.allow_beyond_trained_context) == (128, True)
    assert any(n.startswith("draft: config model.hidden-layers.kv-cache.context-size: 128 tokens is beyond the "
                            "trained context of 64") for n in plan.notes)


def test_a_draft_that_does_not_fit_beside_the_model_is_refused(tiny_checkpoint, monkeypatch):
    """The capacity check counts both models: host RAM for the main model alone and half the draft passes the
    main model alone and refuses it with its draft, naming the draft and what to do about it."""
    main, draft = str(tiny_checkpoint("qwen3_5")), str(tiny_checkpoint("qwen3_5", num_hidden_layers=2))
    raw = {"model": {"path": main, "hidden-layers": {"kv-cache": {"context-size": 64}}},
           "draft": {"path": draft}}
    full = prepare(raw)[3]
    main_bytes = sum(e.nbytes for e in full.entries if not e.component.startswith("draft."))
    draft_bytes = full.pools()["host RAM"] - main_bytes
    monkeypatch.setattr(plan_mod, "host_available_bytes", lambda: main_bytes + draft_bytes // 2)
    prepare({"model": raw["model"]})  # fits alone
    with pytest.raises(PlanError) as info:
        prepare(raw)
    text = str(info.value)
    assert "the plan does not fit: host RAM needs" in text and plan_mod.gib(main_bytes + draft_bytes) in text
    assert f"the draft model ({plan_mod.gib(draft_bytes)} here) can go elsewhere" in text


def test_draft_errors_name_the_draft(tiny_checkpoint, tmp_path):
    main = str(tiny_checkpoint("qwen3_5"))
    with pytest.raises(ConfigError) as info:  # a plan check of the draft's block: its path under draft.
        prepare({"model": {"path": main},
                 "draft": {"model": {"path": main, "hidden-layers": {"kv-cache": {"store": "vram"}}}}})
    assert info.value.path == "draft.model.hidden-layers.kv-cache.store"
    assert info.value.message.startswith("the draft model: ")
    with pytest.raises(Exception, match=r"the draft model: checkpoint not found: .*nowhere.*draft\.model\.path"):
        prepare({"model": {"path": main}, "draft": {"path": str(tmp_path / "nowhere")}})


# ---------------------------------------------------------------- the MTP head


def test_mtp_on_a_checkpoint_without_an_mtp_head_is_refused(tiny_checkpoint):
    main = str(tiny_checkpoint("qwen3_5"))
    with pytest.raises(PlanError) as info:
        prepare({"model": {"path": main}, "draft": {"mtp": True}})
    text = str(info.value)
    assert text.startswith(f"draft.mtp: {main} has no multi-token-prediction head")
    assert "use a draft model instead (draft.path" in text


def with_stand_in_head(arch, tensor: str, cache_bytes):
    """The Qwen architecture as if its checkpoint had a one-layer MTP head made of ``tensor`` (the plan's side of
    MTP, apart from the plugin's own head): with ``use_mtp`` the layout puts it in ``("mtp", None)``."""
    real_layout, real_components = arch.layout, arch.components

    def layout(names):
        use, arch.use_mtp = arch.use_mtp, False
        try:
            out = real_layout(names)
        finally:
            arch.use_mtp = use
        if use:
            out.needs[("mtp", None)] = [tensor]
        arch.mtp_layers = 1  # (the real layout counts the checkpoint's mtp.* tensors: none here)
        return out

    arch.layout = layout
    arch.components = lambda: [c for c in real_components() if c != ("mtp", None)] + (
        [("mtp", None)] if arch.use_mtp else [])
    arch.mtp_layers = 1
    arch.mtp_cache_bytes = cache_bytes
    return arch


def test_mtp_plans_the_head_with_the_output_layer(tiny_checkpoint):
    """draft.mtp sets use_mtp before the layout; the head's row `mtp` is placed as the output layer (store mmap
    here, apart from the layers' ram: its tensor is counted again there) and its cache `cache.mtp` holds
    ``mtp_cache_bytes(context, kv_bytes)`` once on that device (batched generations do not draft)."""
    path = tiny_checkpoint("qwen3_5")
    registry = get_registry()
    ckpt = open_checkpoint(path, registry)
    arch = registry.architecture_class(ckpt.config["model_type"]).from_checkpoint(ckpt)
    tensor = "model.layers.0.mlp.down_proj.weight"
    if tensor not in ckpt.tensors:
        tensor = next(n for n in ckpt.tensors if ".layers.0." in n and arch.is_matrix(n))
    calls = []
    with_stand_in_head(arch, tensor, lambda context, kv_bytes: calls.append((context, kv_bytes)) or 1000)
    config = load_config({"model": {"path": str(path), "output-layer": {"store": "mmap"},
                                    "hidden-layers": {"kv-cache": {"context-size": 80, "type-k": "f16",
                                                                   "type-v": "f16", "sequences": 2}}},
                          "draft": {"mtp": True, "num-draft-tokens": 2}})
    plan, resolved = plan_mod.make_plan(config, arch, ckpt, registry)
    rows = {e.component: e for e in plan.entries}
    assert arch.use_mtp and resolved["placements"][("mtp", None)] == Placement("cpu", "mmap")
    assert (rows["mtp"].device, rows["mtp"].store) == ("cpu", "mmap")
    assert rows["mtp"].nbytes == ckpt.tensors[tensor].nbytes
    assert calls == [(80, 2.0)]
    # one cache although kv-cache.sequences is 2: only a generation that runs alone drafts
    assert (rows["cache.mtp"].kind, rows["cache.mtp"].store, rows["cache.mtp"].nbytes) == ("cache", "ram", 1000)
    assert labels(plan)[-2:] == ["mtp", "cache.mtp"] and resolved["draft_config"] is None
    assert ("mtp", None) in resolved["layout"].needs
    assert plan.notes[-1] == ("speculative decoding: the checkpoint's multi-token-prediction head (1 layer(s)) "
                              "proposes 2 token(s) per verification step")


def test_show_plan_with_mtp_on_a_checkpoint_with_a_head(tiny_checkpoint, capsys):
    """--mtp on a tiny Qwen 3.5 with its MTP head (the Qwen plugin's layout): rows `mtp` (where output-layer is) and
    `cache.mtp` (the plugin's ``mtp_cache_bytes`` at the context), counted in the pools; no draft.* rows."""
    path = tiny_checkpoint("qwen3_5", mtp="random")
    config = load_config({"model": {"path": str(path), "output-layer": {"store": "mmap"},
                                    "hidden-layers": {"kv-cache": {"context-size": 64}}}})
    _, _, arch, plain, _ = prepare(config)
    assert arch.mtp_layers == 1 and "mtp" not in labels(plain)  # without draft.mtp the head is skipped
    _, _, arch, plan, resolved = prepare(config.with_draft(mtp=True, tokens=2))
    rows = {e.component: e for e in plan.entries}
    assert labels(plan)[:len(plain.entries)] == labels(plain) and labels(plan)[-2:] == ["mtp", "cache.mtp"]
    assert (rows["mtp"].store, rows["cache.mtp"].store) == ("mmap", "ram") and rows["mtp"].nbytes > 0
    assert rows["cache.mtp"].nbytes == arch.mtp_cache_bytes(64, 4) > 0
    assert plan.pools()["host RAM"] == plain.pools()["host RAM"] + rows["cache.mtp"].nbytes
    assert resolved["draft_config"] is None and not any(x.startswith("draft.") for x in labels(plan))
    code, out, err = run_cli(capsys, "show-plan", "-c", str(path), "--mtp")
    assert code == 0, err
    assert "cache.mtp" in out and "multi-token-prediction head (1 layer(s)) proposes 4 token(s)" in out


# ---------------------------------------------------------------- backends that cannot rewind their caches


@pytest.fixture
def no_rewind(monkeypatch):
    """A stand-in `wgpu` backend computing with the CPU's ops, with ``speculative = False`` as the real one has."""
    from lumen_cpu.backend import CPUBackend

    from lumen_core.backend import DeviceInfo

    class NoRewind(CPUBackend):
        name = "wgpu"
        speculative = False

        @classmethod
        def devices(cls):
            return [DeviceInfo("wgpu:0", 0, 0, "stand-in: numpy")]

    registry = get_registry()
    real_class, real_ops = registry.backend_class, registry.ops_of
    monkeypatch.setattr(registry, "backend_class", lambda name: NoRewind if name == "wgpu" else real_class(name))
    monkeypatch.setattr(registry, "ops_of", lambda name: real_ops("cpu" if name == "wgpu" else name))
    return NoRewind


def test_the_wgpu_backend_says_it_cannot_run_speculative_decoding():
    from lumen_wgpu.backend import WGPUBackend

    from lumen_core.backend import Backend

    assert Backend.speculative is True and WGPUBackend.speculative is False


@pytest.mark.parametrize("where", ["main", "draft"])
def test_a_draft_with_components_on_a_backend_that_cannot_rewind_is_refused(tiny_checkpoint, no_rewind, where):
    main, draft = str(tiny_checkpoint("qwen3_5")), str(tiny_checkpoint("qwen3_5", num_hidden_layers=2))
    model = {"path": main, "hidden-layers": {"compute": "wgpu:0"} if where == "main" else {}}
    block = {"path": draft, "compute": "wgpu:0" if where == "draft" else "cpu"}
    prepare({"model": model})  # without a draft the stand-in plans
    with pytest.raises(PlanError) as info:
        prepare({"model": model, "draft": block})
    text = str(info.value)
    shown = ("layers.0, layers.1, layers.2 and 1 more" if where == "main"
             else "input-layer, layers.0, layers.1 and 1 more")
    assert "speculative decoding cannot run on backend 'wgpu' yet" in text
    assert f"the {where} model computes {shown} there" in text and f"fix: place the {where} model on cpu" in text


def test_mtp_with_the_head_on_a_backend_that_cannot_rewind_is_refused(tiny_checkpoint, no_rewind):
    path = tiny_checkpoint("qwen3_5")
    registry = get_registry()
    ckpt = open_checkpoint(path, registry)
    arch = registry.architecture_class(ckpt.config["model_type"]).from_checkpoint(ckpt)
    with_stand_in_head(arch, "model.norm.weight", lambda context, kv_bytes: 0)
    config = load_config({"model": {"path": str(path), "output-layer": {"compute": "wgpu:0"}},
                          "draft": {"mtp": True}})
    with pytest.raises(PlanError, match="'wgpu' yet: .* the main model computes output-layer, mtp there"):
        plan_mod.make_plan(config, arch, ckpt, registry)


# ---------------------------------------------------------------- tokenizers


def test_a_draft_must_share_the_main_models_vocabulary_and_eos(tiny_checkpoint):
    qwen, small, gemma = (tiny_checkpoint("qwen3_5"), tiny_checkpoint("qwen3_5", num_hidden_layers=2),
                          tiny_checkpoint("gemma3"))
    main_tok = Tokenizer.from_dir(qwen)
    check_draft_tokenizer(main_tok, Tokenizer.from_dir(small), qwen, small)  # the same tokenizer: accepted
    check_draft_tokenizer(None, None, qwen, small)
    with pytest.raises(InputError) as info:
        check_draft_tokenizer(main_tok, Tokenizer.from_dir(gemma), qwen, gemma)
    text = str(info.value)
    assert "the draft model's tokenizer differs from the main model's" in text
    assert f"the main model {qwen} has {main_tok.vocab_size} tokens" in text and str(gemma) in text
    assert "token " in text and "same vocabulary (token -> id)" in text
    other_eos = Tokenizer(main_tok.backend, special_tokens=main_tok.special_tokens, bos_id=main_tok.bos_id,
                          eos_ids={0})
    with pytest.raises(InputError, match=r"EOS ids \[0\] .* differ from the main model's \[\d+\]"):
        check_draft_tokenizer(main_tok, other_eos, qwen, small)
    with pytest.raises(InputError, match="the draft model .* has no tokenizer"):
        check_draft_tokenizer(main_tok, None, qwen, small)


def test_vocabulary_difference_names_the_first_token_by_id():
    from lumen_core.draft import vocabulary_difference

    assert vocabulary_difference({"a": 0, "b": 1}, {"a": 0, "b": 1}, "M", "D") is None
    assert vocabulary_difference({"a": 0, "b": 1, "c": 2}, {"a": 0, "b": 2, "c": 1}, "M", "D") == \
        "token 'b' is id 1 in the main model M but is id 2 in the draft D"
    assert vocabulary_difference({"a": 0}, {"a": 0, "z": 1}, "M", "D") == \
        "the main model M has 1 tokens and the draft D has 2; token 'z' (id 1 in the draft D) is not in the main " \
        "model M's vocabulary"


# ---------------------------------------------------------------- the command line


def test_show_plan_lists_the_draft_rows_and_the_merged_pools(tiny_checkpoint, capsys, tmp_path, monkeypatch):
    main, draft = tiny_checkpoint("qwen3_5"), tiny_checkpoint("qwen3_5", num_hidden_layers=2)
    monkeypatch.chdir(draft.parent)  # --draft-model relative to the working directory
    code, out, err = run_cli(capsys, "show-plan", "-c", str(main), "--json", "--draft-model", draft.name,
                             "--draft-tokens", "7")
    assert code == 0, err
    plan = json.loads(out)
    drafted = [e for e in plan["entries"] if e["component"].startswith("draft.")]
    assert [e["component"] for e in drafted][:3] == ["draft.input-layer", "draft.layers.0", "draft.cache.layers.0"]
    assert plan["pools"]["host RAM"] == sum(e["nbytes"] for e in plan["entries"])
    assert f"the draft model {draft} proposes 7 token(s)" in plan["notes"][-1]
    code, out, _ = run_cli(capsys, "show-plan", "-c", str(main), "--draft-model", str(draft))
    assert code == 0 and "draft.output-layer" in out and "proposes 4 token(s)" in out


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_draft_options_reach_the_config_the_engine_loads(tiny_checkpoint, capsys, monkeypatch, command):
    """--draft-model / --draft-tokens / --mtp set the config's draft before loading (the engine gets the Config)."""
    import lumen_core.engine as engine

    loaded = []

    def fake_load(source, **_):
        loaded.append(source)
        raise InputError("stop here")

    monkeypatch.setattr(engine, "load", fake_load)
    main, draft = str(tiny_checkpoint("qwen3_5")), str(tiny_checkpoint("qwen3_5", num_hidden_layers=2))
    extra = ["-p", "hi"] if command == "generate" else []
    code, _, err = run_cli(capsys, command, "-c", main, *extra, "--draft-model", draft, "--draft-tokens", "5")
    assert code == 2 and "stop here" in err
    assert loaded[-1].draft().tokens == 5 and str(loaded[-1].draft().config.model_path) == draft
    code, _, err = run_cli(capsys, command, "-c", main, *extra, "--mtp")
    assert code == 2 and "stop here" in err and loaded[-1].draft() == DraftSpec(4, True, None)
    code, _, _ = run_cli(capsys, command, "-c", main, *extra)
    assert (loaded[-1].draft() if command == "serve" else loaded[-1]) == (None if command == "serve" else main)
    code, _, err = run_cli(capsys, command, "-c", main, *extra, "--mtp", "--draft-model", draft)
    assert code == 2 and "not both" in err and len(loaded) == 3


def test_mtp_and_a_mismatched_draft_are_refused_by_the_cli(tiny_checkpoint, capsys):
    main, gemma = str(tiny_checkpoint("qwen3_5")), str(tiny_checkpoint("gemma3"))
    code, _, err = run_cli(capsys, "show-plan", "-c", main, "--mtp")
    assert code == 2 and "has no multi-token-prediction head" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "validate", "-c", main, "--draft-model", gemma)
    assert code == 2 and "the draft model's tokenizer differs from the main model's" in err
    code, out, err = run_cli(capsys, "validate", "-c", main, "--draft-model", main)
    assert code == 0 and "is valid" in out
    code, _, err = run_cli(capsys, "show-plan", "-c", main, "--draft-tokens", "2")
    assert code == 2 and "--draft-tokens 2 needs a draft" in err
