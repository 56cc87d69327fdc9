"""Tokenizer, chat template and streaming detokenizer for a Hugging Face checkpoint directory.

Reads the same files `transformers.AutoTokenizer` reads and reproduces its results (transformers 5.x):
`encode` equals `AutoTokenizer(text)["input_ids"]` and `apply_chat_template` renders the Jinja template
in the same sandbox with the same filters and globals.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from lumen_core.errors import CheckpointError, InputError

SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of its checkpoint."""

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: dict[str, str],
                 bos_id: int | None, eos_ids: set[int], add_bos_token: bool = False,
                 chat_template: str | dict[str, str] | None = None):
        self.backend = backend
        self.special_tokens = special_tokens  # e.g. {"bos_token": "<bos>", "eos_token": "<eos>"}
        self._bos_id = bos_id
        self._eos_ids = set(eos_ids)
        self.chat_template = chat_template
        # where chat_template came from, for notes: "checkpoint", or a sentence (`lumen_core.engine.set_chat_template`)
        self.chat_template_origin = "checkpoint"
        self._post_processor_bos = self._post_processor_adds_bos()
        # transformers 5 lets tokenizer.json's post-processor alone decide. We also honour
        # `add_bos_token: true` when that post-processor adds no BOS (transformers 4 did, and checkpoints
        # were made with it); the two never both apply, so BOS is never doubled.
        self._prepend_bos = add_bos_token and bos_id is not None and not self._post_processor_bos

    # --- loading ---------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path) -> Tokenizer:
        """Load `tokenizer.json` and the config files beside it from an HF checkpoint directory."""
        root = Path(path)
        backend = _load_backend(root)
        tok_cfg = _read_json(root / "tokenizer_config.json")
        special = _special_tokens(tok_cfg, _read_json(root / "special_tokens_map.json"))
        _add_missing_tokens(backend, tok_cfg, special)
        gen_cfg = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")
        return cls(
            backend,
            special_tokens=special,
            bos_id=_resolve_bos(backend, special, gen_cfg, model_cfg),
            eos_ids=_resolve_eos(backend, special, gen_cfg, model_cfg, root),
            add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
            chat_template=_load_chat_template(root, tok_cfg),
        )

    # --- properties ------------------------------------------------------------------------------------

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_ids(self) -> set[int]:
        return set(self._eos_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts with BOS (from any source, exactly once)."""
        return self._prepend_bos or self._post_processor_bos

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # --- encode / decode -------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self._bos_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _post_processor_adds_bos(self) -> bool:
        if self._bos_id is None or self.backend.post_processor is None:
            return False
        # Probe rather than parse: TemplateProcessing, RobertaProcessing, Sequence... all show it here.
        with_special = self.backend.encode("a", add_special_tokens=True).ids
        return bool(with_special) and with_special[0] == self._bos_id

    # --- chat ------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """Render the checkpoint's chat template as `AutoTokenizer.apply_chat_template(tokenize=False)`."""
        template = self._pick_template(tools)
        # HF drops None values: OpenAI-style `content=None` would otherwise render as "None".
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        chat = _alias_reasoning_fields(chat)
        context = {**self.special_tokens, **kwargs}
        try:
            return compile_template(template).render(
                messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as exc:
            raise InputError(f"the chat template refused these messages: {exc}") from exc

    def _pick_template(self, tools) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            key = "tool_use" if tools is not None and "tool_use" in template else "default"
            template = template.get(key)
        if not template:
            raise InputError("the model has no chat template (it cannot chat); send a plain prompt instead")
        return template


# --- loading helpers -----------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _load_backend(root: Path) -> tokenizers.Tokenizer:
    path = root / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: the checkpoint needs a tokenizer.json (the `tokenizers` serialization)"
        )
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception for bad JSON
        raise CheckpointError(f"{path}: cannot be read as a tokenizer ({exc})") from exc


def _token_text(value) -> str | None:
    """A special token from a config: a string or an AddedToken-like `{"content": ...}` dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_tokens(tok_cfg: dict, tokens_map: dict) -> dict[str, str]:
    # tokenizer_config.json wins; special_tokens_map.json is the legacy place for the same keys.
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(tok_cfg.get(key)) or _token_text(tokens_map.get(key))
        if text is not None:
            special[key] = text
    return special


def _add_missing_tokens(backend: tokenizers.Tokenizer, tok_cfg: dict, special: dict[str, str]) -> None:
    """Add tokens that the configs declare but tokenizer.json lacks, as transformers does on load."""
    decoder = tok_cfg.get("added_tokens_decoder") or {}
    for _, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        text = _token_text(entry)
        if text is not None and backend.token_to_id(text) is None:
            backend.add_tokens([_added_token(entry)])
    missing = [t for t in special.values() if backend.token_to_id(t) is None]
    if missing:
        tokens = [tokenizers.AddedToken(t, special=True, normalized=False) for t in missing]
        backend.add_special_tokens(tokens)


def _added_token(entry: dict) -> tokenizers.AddedToken:
    flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
    return tokenizers.AddedToken(entry["content"], **{k: entry[k] for k in flags if k in entry})


def _ids_from_config(cfg: dict, key: str) -> list[int]:
    """`bos_token_id` / `eos_token_id` from a config, int or list, also under a VL `text_config`."""
    value = cfg.get(key)
    if value is None and isinstance(cfg.get("text_config"), dict):
        value = cfg["text_config"].get(key)
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _resolve_bos(backend, special, gen_cfg, model_cfg) -> int | None:
    if "bos_token" in special and backend.token_to_id(special["bos_token"]) is not None:
        return backend.token_to_id(special["bos_token"])
    for cfg in (gen_cfg, model_cfg):
        ids = _ids_from_config(cfg, "bos_token_id")
        if ids:
            return ids[0]
    return None


def _resolve_eos(backend, special, gen_cfg, model_cfg, root: Path) -> set[int]:
    eos = set(_ids_from_config(gen_cfg, "eos_token_id"))
    named = special.get("eos_token")
    if named is not None and backend.token_to_id(named) is not None:
        eos.add(backend.token_to_id(named))
    if not eos:
        eos.update(_ids_from_config(model_cfg, "eos_token_id"))  # last resort: config.json is often stale
    if not eos and named is not None:
        raise CheckpointError(
            f"{root}: the end-of-sequence token {named!r} is not in tokenizer.json and no config gives "
            "an eos_token_id; generation could never stop"
        )
    return eos


def read_chat_template(root: Path) -> str | dict[str, str] | None:
    """The chat template of an HF checkpoint directory (None: none), without loading its tokenizer."""
    return _load_chat_template(Path(root), _read_json(Path(root) / "tokenizer_config.json"))


def _load_chat_template(root: Path, tok_cfg: dict) -> str | dict[str, str] | None:
    """chat_template.jinja (and additional_chat_templates/*.jinja) win over tokenizer_config, as in HF."""
    templates = {}
    if (root / "chat_template.jinja").is_file():
        templates["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # the older form: [{"name": ..., "template": ...}]
        return {t["name"]: t["template"] for t in template}
    return template


# --- chat template rendering ---------------------------------------------------------------------------


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    # HF fills `reasoning_content` from older names (and `thinking`, which gpt-oss templates read).
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters and sorts keys; HF templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names so a template cannot reach CPython internals."""

    def __init__(*args, **kwargs):  # same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself (as HF does)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` (assistant-mask markers) and render the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandbox and with the same helpers transformers uses."""
    if source not in _TEMPLATE_CACHE:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                           namespace=_Namespace, dict=_TemplateDict())
        _TEMPLATE_CACHE[source] = env.from_string(source)
    return _TEMPLATE_CACHE[source]


# --- streaming -----------------------------------------------------------------------------------------


class StreamDecoder:
    """Incremental detokenizer: `push` returns only newly completed text, never half a UTF-8 character.

    Decodes a window that starts one step back (prefix_offset) so decoders that strip a leading space
    (SentencePiece) or merge bytes (byte-level BPE) see the same context as a full decode. Text is held
    while the window's tail decodes to U+FFFD, i.e. a multi-byte character is still incomplete.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # end of the text already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text, new_text = self._window()
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """The held-back tail (an incomplete character decodes to U+FFFD, as a full decode does)."""
        prefix_text, new_text = self._window()
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]

    def _window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        new_text = decode(self.ids[self.prefix_offset:], skip_special_tokens=skip)
        return prefix_text, new_text


class StopMatcher:
    """Cut streamed text at the first stop string, never emitting any part of one.

    `push` holds back the longest tail that could still grow into a stop string.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.held += text
        cut = self._first_stop()
        if cut is not None:
            emit, self.held, self.stopped = self.held[:cut], "", True
            return emit, True
        keep = self._partial_tail()
        emit = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return emit, False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held

    def _first_stop(self) -> int | None:
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_tail(self) -> int:
        """Length of the longest tail of `held` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.held)), best, -1):
                if self.held.endswith(stop[:n]):
                    best = n
                    break
        return best
