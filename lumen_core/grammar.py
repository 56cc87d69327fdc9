"""Structured output: grammars that constrain what a generation may write (issue 18).

Built on llguidance (MIT; one ~3 MB wheel, no dependencies; the measurements behind the choice are in
docs/structured-output.md): a grammar is a Lark text with inline JSON schemas (``%json {...}``), compiled against
the engine's tokenizer; before each sampled token its mask of the vocabulary (a bitmask) sets every token the
grammar forbids to -inf, and after sampling the token advances it. The engine calls the two hooks
(``Engine.generate_tokens(..., constraint=)``): ``Constraint.mask(row) -> row`` and ``Constraint.advance(token)``.

Three kinds of grammar:

* ``json_grammar(engine, schema)``: a JSON value following ``schema`` (``None``: any JSON object, OpenAI's
  ``json_object``), for ``Engine.generate`` and chat answers;
* ``chat_grammar(engine, messages, tools, think, force, schema=, constrain_tools=)``: a whole chat reply in the model
  family's syntax: the rest of an open reasoning block first (Qwen 3.5's prompt opens ``<think>``; the reasoning is
  free text, the constraint starts after its end tag), or an optional reasoning block where the model opens it
  itself (Gemma 4's thought channel); then the answer as JSON (``schema``) and/or tool calls whose arguments follow
  each tool's parameter schema, in the format's own call syntax (Qwen 3.5's ``<function=..><parameter=..>`` XML with
  raw-text strings, Gemma 4's ``call:name{key:<|"|>text<|"|>}``). A forced call (``force``: ``tool_choice`` required or
  a named function) continues the opener ``Engine.chat`` writes after the prompt.

When the grammar is complete the mask allows only the end-of-sequence tokens (``tokenizer.eos_ids``), so the
generation ends there; a row longer than the tokenizer's vocabulary (a padded embedding) has its extra ids
forbidden. The tokenizer is bound to llguidance once per engine, on the first structured request (~2.5 s for a
250k vocabulary on 2 cores, ``for_engine``); each request compiles its grammar (about a millisecond) and each
generation gets its own ``Constraint`` (not thread-bound: a batcher thread may run it).

A schema llguidance cannot enforce (an unsupported keyword, a pattern its regex engine refuses) is an InputError
naming the reason, never a silently unconstrained reply; so is a tool-call syntax with no grammar here.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import numpy as np

from .errors import InputError

INSTALL = 'pip install "llguidance>=1.9,<2"'
# JSON answers: whitespace where JSON allows it, at most 16 characters at a time (a model that would otherwise
# write whitespace forever still has to close the document).
ANSWER_JSON = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
# JSON inside a tool call's syntax: compact, so the value ends where the call's syntax resumes.
INLINE_JSON = {"whitespace_flexible": False}
_SEP_WS = r"/[ \t\r\n]{0,4}/"  # between a closed reasoning block (or a call) and what follows


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # an optional install in a trimmed environment
        raise InputError(f"structured output needs the llguidance package: {INSTALL}") from exc
    return llguidance


def check_schema(schema: Any, where: str = "schema") -> dict:
    """``schema`` as a dict that is a valid JSON Schema (its own metaschema's check), or an InputError naming
    ``where`` and the problem."""
    import jsonschema

    if not isinstance(schema, dict):
        raise InputError(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p!r}]" for p in exc.absolute_path)
        raise InputError(f"{where}{path} is not a valid JSON Schema: {exc.message}") from exc
    return schema


# --- the tokenizer bound to llguidance: one per engine ---------------------------------------------------------


class Grammars:
    """llguidance's view of one tokenizer (``LLTokenizer``, immutable and shareable across threads)."""

    def __init__(self, tokenizer):
        llg = _llguidance()
        self.tokenizer = tokenizer
        self.eos_ids = sorted(tokenizer.eos_ids)
        if not self.eos_ids:
            raise InputError("structured output needs an end-of-sequence token; the tokenizer has none")
        self.lt = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=self.eos_ids)
        self.vocab_size = self.lt.vocab_size

    def literal(self, text: str) -> str:
        """A Lark expression matching ``text`` as the tokenizer writes it: its special tokens as ``<[id]>`` (a
        special token is no text to a grammar), the rest as quoted strings."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        parts: list[str] = []
        run: list[int] = []
        for i in [*ids, None]:
            if i is not None and not self.lt.is_special_token(i):
                run.append(i)
                continue
            if run:
                parts.append(_quote(self.tokenizer.decode(run)))
                run = []
            if i is not None:
                parts.append(f"<[{i}]>")
        return " ".join(parts) if parts else '""'

    def special_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one special token, else None."""
        i = self.tokenizer.token_to_id(text)
        return i if i is not None and self.lt.is_special_token(i) else None

    def compile(self, lark: str) -> Grammar:
        """Validate a Lark grammar against this tokenizer; an InputError names what llguidance refused."""
        llg = _llguidance()
        text = llg.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, self.lt)
        if is_error:
            raise InputError(f"the schema cannot be enforced: {_first_line(messages[0])}")
        return Grammar(self, text, lark)


def for_engine(engine) -> Grammars:
    """The engine's Grammars, built on first use and kept on the engine (dropping the engine drops it)."""
    g = engine.__dict__.get("_grammars")
    if g is not None:
        return g
    if getattr(engine, "tokenizer", None) is None:
        raise InputError("structured output needs the model's tokenizer; this model has none")
    lock = engine.__dict__.setdefault("_grammars_lock", threading.Lock())  # setdefault: atomic under the GIL
    with lock:
        g = engine.__dict__.get("_grammars")
        if g is None:
            g = engine.__dict__["_grammars"] = Grammars(engine.tokenizer)
    return g


class Grammar:
    """A compiled (validated) grammar; ``constraint()`` gives each generation its own matcher."""

    def __init__(self, grammars: Grammars, text: str, lark: str):
        self.grammars, self.text, self.lark = grammars, text, lark

    def constraint(self) -> Constraint:
        return Constraint(self.grammars, self.text)


class Constraint:
    """One generation's grammar state: ``mask(row)`` and ``advance(token)``, the engine's constraint hooks."""

    def __init__(self, grammars: Grammars, text: str):
        self.matcher = _llguidance().LLMatcher(grammars.lt, text, log_level=0)
        if self.matcher.is_error():
            raise InputError(f"the grammar cannot be enforced: {_first_line(self.matcher.get_error())}")
        self.vocab_size = grammars.vocab_size
        self._bits = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """A bool per tokenizer id: may it come next?"""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.matcher.is_error():
            raise RuntimeError(f"structured output: the grammar failed: {_first_line(self.matcher.get_error())}")
        return np.unpackbits(self._bits.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)

    def mask(self, row: np.ndarray) -> np.ndarray:
        """A copy of the logits ``row`` with every token the grammar forbids at -inf (ids past the tokenizer's
        vocabulary too); when the grammar is complete only the end-of-sequence tokens remain."""
        row = np.asarray(row, dtype=np.float32)
        allowed = self.allowed()
        n = min(self.vocab_size, row.shape[-1])
        if not allowed[:n].any():
            raise RuntimeError("structured output: the grammar allows no token of the model's vocabulary")
        out = np.full(row.shape, -np.inf, dtype=np.float32)
        np.copyto(out[:n], row[:n], where=allowed[:n])
        return out

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"structured output: token {int(token)} does not follow the grammar: "
                               f"{_first_line(self.matcher.get_error())}")

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()


# --- grammars ---------------------------------------------------------------------------------------------------


def json_grammar(engine, schema: dict | None = None) -> Grammar:
    """Any JSON object (``schema`` None: OpenAI's ``json_object``), or a JSON value following ``schema``."""
    g = for_engine(engine)
    return g.compile("start: " + _json(ANY_OBJECT if schema is None else check_schema(schema), ANSWER_JSON))


ANY_OBJECT = {"type": "object"}


def chat_grammar(engine, messages: list[dict], tools: list[dict] | None = None, think: bool | None = None,
                 force: bool | str = False, *, schema: dict | None = None, json_answer: bool = False,
                 constrain_tools: bool = False, parallel: bool = True) -> Grammar | None:
    """The grammar of a whole chat reply (None when nothing is constrained), rendered as ``Engine.chat`` renders
    the prompt (same ``messages, tools, think, force``):

    * ``json_answer`` (or a ``schema``): the answer is JSON (any object, or following ``schema``); with ``tools``
      (``tool_choice`` auto) the reply may instead be tool calls, their arguments following the tools' schemas;
    * ``force`` (True: any tool, a name: that tool): the reply is tool calls, continuing the opener ``Engine.chat``
      writes after the prompt;
    * ``constrain_tools`` (a tool is ``strict``): free text, then optionally tool calls with valid arguments;
    * ``parallel`` False: at most one call (``parallel_tool_calls: false``).

    Reasoning stays free: the grammar starts after an open reasoning block's end tag, or allows the family's
    reasoning block first where the model opens it itself."""
    from .chat import prompt_ends_in_reasoning

    json_answer = json_answer or schema is not None
    constrain_tools = constrain_tools and bool(tools)
    if not (json_answer or force or constrain_tools):
        return None
    g = for_engine(engine)
    if schema is not None:
        check_schema(schema)
    prompt, fmt, _, _ = engine.chat_prompt_and_parser(messages, tools, think, None, force)
    calls = None
    if tools and (force or constrain_tools):
        calls = _call_syntax(g, fmt, tools, parallel)
    elif tools:  # a JSON answer, or tool calls (with valid arguments where the format has a call grammar)
        try:
            calls = _call_syntax(g, fmt, tools, parallel)
        except InputError:
            calls = None
    rules: list[str] = []
    if force:
        body = calls.forced(force if isinstance(force, str) else None, rules)
    else:
        answer = _json(ANY_OBJECT if schema is None else schema, ANSWER_JSON) if json_answer else None
        call_list = calls.calls(rules) if calls is not None and answer is not None else None
        if answer is not None and call_list is not None:
            body = f"({answer} | {call_list})"
        elif answer is not None:
            body = answer
        else:
            body = calls.text_then_calls(rules)
    prefix = ""
    r = fmt.reasoning
    if r is not None and not force:
        if prompt_ends_in_reasoning(prompt, fmt):
            prefix = _reasoning_rest(g, r.end, rules) + f" {_SEP_WS} "
        elif not prompt.rstrip().endswith(r.end) and think is not False:
            # the model may open its reasoning block itself (Gemma 4's thought channel)
            rules.append(f"reasoning: {g.literal(r.start)} {_reasoning_rest(g, r.end, rules)} {_SEP_WS}")
            prefix = "reasoning? "
    return g.compile("\n".join([f"start: {prefix}{body}", *rules]))


def reply_grammar(engine, messages: list[dict], tools: list[dict] | None = None, think: bool | None = None,
                  force: bool | str = False, *, schema: dict | None = None, json_answer: bool = False,
                  strict: bool = False, parallel: bool = True) -> Grammar | None:
    """What the servers constrain (``chat_grammar``'s arguments; ``strict``: a tool asked for it): a JSON answer and
    strict tools always (a schema that cannot be enforced, or a family without a call grammar, is an InputError, so
    a 400); a forced call's arguments wherever the family has a call grammar and the tools' schemas compile, else
    (no strict tool) the call runs unconstrained, as it did before grammars."""
    try:
        return chat_grammar(engine, messages, tools, think, force, schema=schema, json_answer=json_answer,
                            constrain_tools=strict, parallel=parallel)
    except InputError:
        if json_answer or schema is not None or strict or not force:
            raise
        return None


def _reasoning_rest(g: Grammars, end: str, rules: list[str]) -> str:
    """Free text up to and including the reasoning block's end tag."""
    special = g.special_id(end)
    if special is not None:
        rules.append("REASONING: /(?s:.*)/")
        return f"REASONING <[{special}]>"
    rules.append(f"REASONING: ({_ANY} & ~{_containing(end)}) {_quote(end)}")
    return "REASONING"


# --- tool-call syntaxes -----------------------------------------------------------------------------------------


def _call_syntax(g: Grammars, fmt, tools: list[dict], parallel: bool = True):
    syntax = fmt.tool_calls
    kinds = {("<tool_call>", "</tool_call>"): QwenCalls, ("<|tool_call>", "<tool_call|>"): GemmaCalls}
    kind = kinds.get((getattr(syntax, "start", None), getattr(syntax, "end", None)))
    if kind is None:
        raise InputError(f"tool-call arguments cannot be constrained in the {fmt.name!r} chat format (no grammar "
                         "for its call syntax); leave out strict and use tool_choice auto")
    return kind(g, syntax, tools, parallel)


def _functions(tools: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InputError(f"tools[{i}] has no function name")
        params = fn.get("parameters")
        params = {} if params is None else check_schema(params, f"tools[{i}].function.parameters")
        if params.get("type", "object") != "object":
            raise InputError(f"tools[{i}].function.parameters must describe an object (type 'object')")
        out.append((fn["name"], params))
    return out


class _Calls:
    """A family's call syntax as Lark rules: ``calls`` (one or more whole calls), ``forced`` (the rest of a call
    whose opener ends the prompt, then more calls), ``text_then_calls`` (free content, then optionally calls)."""

    def __init__(self, g: Grammars, syntax, tools: list[dict], parallel: bool = True):
        self.g, self.syntax, self.functions, self.parallel = g, syntax, _functions(tools), parallel
        self.start, self.end = g.literal(syntax.start), g.literal(syntax.end)
        self._built = False

    def _build(self, rules: list[str]) -> None:
        if not self._built:
            self._built = True
            rules.extend(self.function_rules())
            rules.append(f"call: {self.start} {self.head()} fn {self.end}")
            rules.append("fn: " + " | ".join(f"fn{i}" for i in range(len(self.functions))))
            rules.append(f"more_calls: ({_SEP_WS} call)*" if self.parallel else 'more_calls: ""')

    def calls(self, rules: list[str]) -> str:
        self._build(rules)
        return "call more_calls"

    def forced(self, name: str | None, rules: list[str]) -> str:
        self._build(rules)
        opener = self.syntax.opener(name)[len(self.syntax.start):]  # what the prompt already holds after the tag
        if name is None:
            return f"{self.after_head(opener)} fn {self.end} more_calls"
        i = next((k for k, (n, _) in enumerate(self.functions) if n == name), None)
        if i is None:
            raise InputError(f"tool_choice names {name!r}, which is not among the tools")
        return f"{self.after_name(i, opener)} {self.end} more_calls"

    def text_then_calls(self, rules: list[str]) -> str:
        """Free content, then optionally calls. A textual call tag ends the text inside one terminal (text that
        cannot contain the tag, then the tag), so the lexer never has to guess where the text ends."""
        self._build(rules)
        if self.g.special_id(self.syntax.start) is not None:
            rules.append("TEXT: /(?s:.*)/")
            return "TEXT (call more_calls)?"
        free = f"{_ANY} & ~{_containing(self.syntax.start)}"
        rules.append(f"TEXT: {free}")
        rules.append(f"CALL_HEAD: ({free}) {_quote(self.syntax.start)}")
        return f"(TEXT | CALL_HEAD {self.head()} fn {self.end} more_calls)"

    # per syntax
    def head(self) -> str: ...
    def after_head(self, opener: str) -> str: ...
    def after_name(self, i: int, opener: str) -> str: ...
    def function_rules(self) -> list[str]: ...


class QwenCalls(_Calls):
    """Qwen 3.5: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...``
    ``</function>\\n</tool_call>``. A string VALUE is raw text (one terminal with its closing tag, so the lexer
    never has to guess where the text ends), any other value compact JSON (the parser types values by the tool's
    schema: ``chat.convert_value``)."""

    FORBIDDEN = r"/(?s:.*)<\/?(parameter|function|tool_call)(?s:.*)/"

    def head(self) -> str:
        return _quote("\n<function=")

    def after_head(self, opener: str) -> str:
        if opener != "\n":
            raise InputError("the Qwen tool-call opener changed; the call grammar does not match it")
        return _quote("<function=")

    def after_name(self, i: int, opener: str) -> str:
        return f"params{i} {_quote('</function>' + chr(10))}"

    def function_rules(self) -> list[str]:
        rules = []
        for i, (name, params) in enumerate(self.functions):
            if re.search(r"[>\n]", name):
                raise InputError(f"tool name {name!r}: a Qwen tool call cannot carry '>' or a newline in a name")
            rules.append(f"fn{i}: {_quote(name + '>' + chr(10))} params{i} {_quote('</function>' + chr(10))}")
            items = []
            for j, (key, sub, required) in enumerate(_properties(params, f"tool {name!r}")):
                if re.search(r"[>\n]", key):
                    raise InputError(f"tool {name!r}: parameter {key!r} cannot carry '>' or a newline in Qwen's "
                                     "call syntax")
                rule = f"p{i}_{j}"
                defs = {k: params[k] for k in ("$defs", "definitions") if k in params}  # what a $ref points into
                rules.append(self._parameter(rule, key, sub, f"tool {name!r} parameter {key!r}", defs))
                items.append(rule if required else f"{rule}?")
            rules.append(f"params{i}: {' '.join(items)}" if items else f'params{i}: ""')
        return rules

    def _parameter(self, rule: str, key: str, schema: dict, where: str, defs: dict) -> str:
        """The parser (``chat.convert_value``) types a value by the schema's main type: a string (or no type) is
        the raw text, anything else is read as JSON; so a string-typed value is raw text under the string option's
        keywords, the others compact JSON under the whole schema."""
        from .chat import schema_type

        open_, close = _quote(f"<parameter={key}>\n"), _quote("\n</parameter>\n")
        schema = _deref(schema, defs, where)
        t = schema_type(schema)
        if t is None and (_json_only(schema) or _non_string_literals(schema)):
            raise InputError(f"{where}: Qwen's call syntax types a value by its schema's 'type', and this one has "
                             "none a raw text can satisfy; give the parameter a 'type'")
        if t is None or t == "string":
            option = _string_option(schema)
            if _non_string_literals({k: v for k, v in option.items() if k == "const"}):
                raise InputError(f"{where}: a string parameter with a non-string const")
            term, text = rule.upper(), _string_text(option, where)
            if text.startswith('"') or " | " in text:  # literals: they cannot hold the call's tags
                return f"{rule}: {term}\n{term}: {open_} ({text}) {close}"
            return f"{rule}: {term}\n{term}: {open_} ({text} & ~{self.FORBIDDEN}) {close}"
        safe = {k: {name: _xml_safe(d) for name, d in v.items()} if isinstance(v, dict) else v for k, v in defs.items()}
        return f"{rule}: {open_} {_json({**safe, **_xml_safe(schema)}, INLINE_JSON)} {close}"


class GemmaCalls(_Calls):
    """Gemma 4: ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1,flag:true,list:[...],obj:{...}}<tool_call|>``, the
    arguments written in Gemma's own syntax from each tool's schema (objects, arrays, strings, numbers, booleans,
    null, enums, anyOf / oneOf / type lists); numbers, booleans and null as compact JSON literals."""

    QUOTE = '<|"|>'

    def __init__(self, g, syntax, tools, parallel=True):
        super().__init__(g, syntax, tools, parallel)
        self.quote_id = g.special_id(self.QUOTE)
        self._n = 0
        self._rules: list[str] = []
        self._refs: dict[str, str] = {}  # a $ref -> its rule (so recursive schemas stay finite)
        self._root: dict = {}

    def head(self) -> str:
        return _quote("call:")

    def after_head(self, opener: str) -> str:
        if opener != "call:":
            raise InputError("the Gemma tool-call opener changed; the call grammar does not match it")
        return ""

    def after_name(self, i: int, opener: str) -> str:
        return f"args{i}"

    def function_rules(self) -> list[str]:
        rules = []
        for i, (name, params) in enumerate(self.functions):
            if re.search(r"[{}\s<]", name):
                raise InputError(f"tool name {name!r}: Gemma's call syntax cannot carry it")
            rules.append(f"fn{i}: {_quote(name)} args{i}")
            self._root, self._refs = params, {}
            rules.append(f"args{i}: {self._value(params, f'tool {name!r}')}")
        return rules + self._rules

    def _new(self, body: str, terminal: bool = False) -> str:
        self._n += 1
        name = f"G{self._n}" if terminal else f"g{self._n}"
        self._rules.append(f"{name}: {body}")
        return name

    def _string(self, schema: dict, where: str) -> str:
        text = _string_text(schema, where)
        if self.quote_id is not None:
            q = f"<[{self.quote_id}]>"
            body = text if text.startswith('"') or " | " in text else self._new(text, terminal=True)
            return f"{q} ({body}) {q}"
        q = _quote(self.QUOTE)
        inner = text if text.startswith('"') or " | " in text else f"{text} & ~{_containing(self.QUOTE)}"
        return self._new(f"{q} ({inner}) {q}", terminal=True)

    def _key(self, key: str) -> str:
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            return _quote(key)
        if self.quote_id is not None:
            return f"<[{self.quote_id}]> {_quote(key)} <[{self.quote_id}]>"
        return _quote(self.QUOTE + key + self.QUOTE)

    def _literal(self, value) -> str:
        if isinstance(value, str):
            if self.quote_id is not None:
                return f"<[{self.quote_id}]> {_quote(value)} <[{self.quote_id}]>"
            return _quote(self.QUOTE + value + self.QUOTE)
        if isinstance(value, dict):
            items = [f"{self._key(k)} \":\" {self._literal(v)}" for k, v in value.items()]
            return '"{" ' + ' "," '.join(items) + ' "}"' if items else '"{}"'
        if isinstance(value, list):
            items = [self._literal(v) for v in value]
            return '"[" ' + ' "," '.join(items) + ' "]"' if items else '"[]"'
        return _quote(json.dumps(value))

    def _value(self, schema: Any, where: str) -> str:
        if schema is True or schema == {}:
            return self._any()
        if not isinstance(schema, dict):
            raise InputError(f"{where}: a schema must be an object")
        if "$ref" in schema:
            if set(schema) - {"$ref", "description", "title"}:
                return self._value(_deref(schema, self._root, where), where)
            ref = schema["$ref"]
            if ref not in self._refs:  # one rule per reference: a recursive schema refers back to it
                self._n += 1
                self._refs[ref] = name = f"ref{self._n}"
                self._rules.append(f"{name}: {self._value(_deref(schema, self._root, where), where)}")
            return self._refs[ref]
        unsupported = sorted(set(schema) & _GEMMA_UNSUPPORTED)
        if unsupported:
            raise InputError(f"{where} uses {', '.join(unsupported)}, which Gemma 4's tool-call grammar does not "
                             "cover; leave out strict (and use tool_choice auto) for this tool")
        if "const" in schema:
            return self._literal(schema["const"])
        if "enum" in schema:
            return "(" + " | ".join(self._literal(v) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                base = {k: v for k, v in schema.items() if k != key}
                return "(" + " | ".join(self._value({**base, **opt}, f"{where}.{key}[{k}]")
                                        for k, opt in enumerate(schema[key])) + ")"
        t = schema.get("type")
        if isinstance(t, list):
            return "(" + " | ".join(self._value({**schema, "type": x}, where) for x in t) + ")"
        if t is None:
            return self._any() if not ({"properties", "required"} & set(schema)) else self._object(schema, where)
        if t == "string":
            return self._string(schema, where)
        if t == "object":
            return self._object(schema, where)
        if t == "array":
            return self._array(schema, where)
        if t in ("integer", "number", "boolean", "null"):
            return _json(schema, INLINE_JSON)
        raise InputError(f"{where}: type {t!r} is not a JSON Schema type")

    def _object(self, schema: dict, where: str) -> str:
        props = _properties(schema, where)
        req = [f"{self._key(k)} \":\" {self._value(s, f'{where}.{k}')}" for k, s, r in props if r]
        opt = [f"{self._key(k)} \":\" {self._value(s, f'{where}.{k}')}" for k, s, r in props if not r]
        if req:
            body = ' "," '.join(req) + "".join(f' ("," {o})?' for o in opt)
            return self._new(f'"{{" {body} "}}"')
        if opt:
            item = self._new(" | ".join(opt))
            return self._new(f'"{{" ({item} ("," {item})*)? "}}"')
        return '"{}"'

    def _array(self, schema: dict, where: str) -> str:
        items = schema.get("items", {})
        if not isinstance(items, dict | bool):
            raise InputError(f"{where}: tuple-style items are not covered by Gemma 4's tool-call grammar")
        item = self._new(self._value(items, f"{where}[]"))
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        if hi is not None and int(hi) == 0:
            return '"[]"'
        rest = f'("," {item})' + (f"{{{max(lo - 1, 0)},{int(hi) - 1}}}" if hi is not None else
                                  (f"{{{lo - 1},}}" if lo > 1 else "*"))
        body = f'"[" {item} {rest} "]"'
        return self._new(body if lo > 0 else f'{body} | "[]"')

    def _any(self) -> str:
        if "gany" not in self.__dict__:
            self.gany = True
            s = self._string({}, "any value")
            scalar = _json({"type": ["number", "boolean", "null"]}, INLINE_JSON)
            self._rules.append(f'gany: {s} | {scalar} | "{{" (gkey ":" gany ("," gkey ":" gany)*)? "}}" '
                               f'| "[" (gany ("," gany)*)? "]"')
            self._rules.append(r"gkey: GKEY" + "\n" + r"GKEY: /[A-Za-z_][A-Za-z0-9_]*/")
        return "gany"


_GEMMA_UNSUPPORTED = {"allOf", "not", "if", "then", "else", "patternProperties",
                      "dependentRequired", "dependentSchemas", "prefixItems", "contains", "uniqueItems",
                      "minProperties", "maxProperties"}


# --- helpers ----------------------------------------------------------------------------------------------------

_ANY = "/(?s:.*)/"


def _quote(text: str) -> str:
    """A Lark string literal (JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


def _containing(text: str) -> str:
    """A regex for any text that contains ``text``."""
    return _regex("(?s:.*)" + "".join(_escape(c) for c in text) + "(?s:.*)")


def _escape(c: str) -> str:
    return "\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c


def _json(schema: dict, options: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def _json_only(schema: dict) -> bool:
    """A schema whose keywords a raw text cannot be checked against (combinators, references)."""
    return any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "not"))


# A string inside a JSON value of Qwen's XML call syntax must not hold the call's tags (``</parameter>``,
# ``<parameter=``, ``</function>``, ``</tool_call>``: the parser cuts the value there): no "<" followed by "/" or "p".
_XML_SAFE_TEXT = r"^(?:[^<]|<[^/p])*<?$"


def _xml_safe(schema: Any) -> Any:
    """``schema`` narrowed so that no string of a matching JSON value can hold Qwen's call tags: string schemas
    get the pattern above (intersected with their own through allOf), objects no keys beyond their declared ones
    (keys are strings too; a required key without a property schema is declared as any value). Every value this
    accepts the original schema accepts."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {k: _xml_safe(v) for k, v in out[key].items()}
    for key in ("items", "additionalProperties", "contains"):
        if isinstance(out.get(key), dict):
            out[key] = _xml_safe(out[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [_xml_safe(v) for v in out[key]]
    types = out.get("type")
    types = [types] if isinstance(types, str) else (types if isinstance(types, list) else [])
    if "string" in types:
        out["allOf"] = [*out.get("allOf", []), {"pattern": _XML_SAFE_TEXT}]
    if "object" in types or "properties" in out:
        props = dict(out.get("properties") or {})
        extra = out.get("additionalProperties")
        for k in out.get("required") or []:
            props.setdefault(k, extra if isinstance(extra, dict) else {})
        out["properties"], out["additionalProperties"] = props, False
    return out


def _deref(schema: dict, root: dict, where: str) -> dict:
    """``schema`` with its own ``$ref`` (a chain of them) replaced by the target in ``root`` (local ``#/...``
    pointers), the referring schema's other keywords kept."""
    seen: list[str] = []
    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise InputError(f"{where}: $ref {ref!r}: only local references ('#/$defs/...') are supported")
        if ref in seen:
            raise InputError(f"{where}: $ref {ref!r} refers to itself")
        seen.append(ref)
        target: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise InputError(f"{where}: $ref {ref!r} points to nothing in the schema")
            target = target[part]
        if not isinstance(target, dict):
            raise InputError(f"{where}: $ref {ref!r} does not point to a schema object")
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _non_string_literals(schema: dict) -> bool:
    values = list(schema.get("enum") or []) + ([schema["const"]] if "const" in schema else [])
    return any(not isinstance(v, str) for v in values) and not any(isinstance(v, str) for v in values)


def _string_option(schema: dict) -> dict:
    """The part of a string-typed schema a raw text answers to: the schema itself (``type`` string or a list with
    string), else its first anyOf / oneOf option of type string (with the schema's other keywords)."""
    from .chat import schema_type

    t = schema.get("type")
    if t == "string" or (isinstance(t, list) and "string" in t) or not _json_only(schema):
        return {k: v for k, v in schema.items() if k != "type"}
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            if schema_type(option) == "string":
                base = {k: v for k, v in schema.items() if k not in (key, "type")}
                return _string_option({**base, **option})
    return {}


def _properties(schema: dict, where: str) -> list[tuple[str, dict, bool]]:
    """(key, its schema, required) in the schema's order, required keys without a property schema last."""
    props = schema.get("properties") or {}
    required = schema.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list):
        raise InputError(f"{where}: properties must be an object and required a list")
    out = [(k, s if isinstance(s, dict) else {}, k in required) for k, s in props.items()]
    out += [(k, {}, True) for k in required if k not in props]
    return out


def _string_text(schema: dict, where: str) -> str:
    """A Lark expression for a raw string's text under ``schema``'s string keywords: enum/const (literals), pattern
    (anchored as JSON Schema reads it: a search), minLength/maxLength; format is not enforced."""
    if "const" in schema:
        return _quote(str(schema["const"]))
    if "enum" in schema:
        values = [v for v in schema["enum"] if isinstance(v, str)]
        if not values:
            raise InputError(f"{where}: a string enum without string values")
        return " | ".join(_quote(v) for v in values)
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    length = None
    if lo is not None or hi is not None:
        upper = "" if hi is None else str(int(hi))
        length = _regex("(?s:.{" + str(int(lo or 0)) + "," + upper + "})")
    pattern = schema.get("pattern")
    if pattern is not None:
        head, tail = pattern.startswith("^"), pattern.endswith("$") and not pattern.endswith("\\$")
        core = pattern[1 if head else 0:len(pattern) - (1 if tail else 0)]
        expr = _regex(("" if head else "(?s:.*)") + f"(?:{core})" + ("" if tail else "(?s:.*)"))
        return expr if length is None else f"{expr} & {length}"
    return _ANY if length is None else length


def _first_line(message: str) -> str:
    """llguidance's message, on one line, without its grammar position (the grammar is ours, not the caller's)."""
    text = " ".join(line.strip() for line in (message or "unknown error").strip().splitlines() if line.strip())
    text = re.sub(r"^at \d+\(\d+\): ", "", text)
    return re.split(r" \d+ \| ", text)[0][:400]  # the grammar's own listing follows
