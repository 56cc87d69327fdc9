"""What a draft model must share with the main model for speculative decoding (issue 20).

The draft proposes token ids that the main model verifies as its own: the same id must be the same token in both
(their vocabularies, token -> id, are equal) and both must stop on the same ids (their EOS ids are equal).
``Engine.load`` calls ``check_draft_tokenizer`` after loading the draft, before any token is drafted.
"""

from __future__ import annotations

import os

from .errors import InputError

FIX = ("use a draft of the same model family, made with the same tokenizer (e.g. a smaller size of the same "
       "release), or draft with the checkpoint's multi-token-prediction head (draft.mtp: true)")


def check_draft_tokenizer(main_tok, draft_tok, main_path: str | os.PathLike, draft_path: str | os.PathLike) -> None:
    """Refuse (``InputError`` naming both checkpoints) a draft whose tokenizer does not map every token to the main
    model's id, or whose EOS ids differ. ``main_tok`` / ``draft_tok``: ``lumen_core.tokenizer.Tokenizer`` (None:
    the checkpoint has none; two without a tokenizer are accepted, as ids are all they share)."""
    if main_tok is None and draft_tok is None:
        return
    if main_tok is None or draft_tok is None:
        which, path = ("main model", main_path) if main_tok is None else ("draft model", draft_path)
        raise InputError(f"the {which} {path} has no tokenizer, so Lumen cannot check that the draft "
                         f"{draft_path} shares the main model {main_path}'s vocabulary; {FIX}")
    difference = vocabulary_difference(main_tok.backend.get_vocab(with_added_tokens=True),
                                       draft_tok.backend.get_vocab(with_added_tokens=True), main_path, draft_path)
    if difference:
        raise InputError(f"the draft model's tokenizer differs from the main model's: {difference}; speculative "
                         f"decoding needs the same vocabulary (token -> id) in both; {FIX}")
    main_eos, draft_eos = sorted(main_tok.eos_ids), sorted(draft_tok.eos_ids)
    if main_eos != draft_eos:
        raise InputError(f"the draft model's EOS ids {draft_eos} ({draft_path}) differ from the main model's "
                         f"{main_eos} ({main_path}): the two would stop on different tokens; {FIX}")


def vocabulary_difference(main: dict[str, int], draft: dict[str, int], main_path, draft_path) -> str | None:
    """How two vocabularies (token -> id) differ, in words (their sizes where those differ, and the first token by
    id that the two map differently); None where they are equal."""
    if main == draft:
        return None
    sizes = (f"the main model {main_path} has {len(main)} tokens and the draft {draft_path} has {len(draft)}; "
             if len(main) != len(draft) else "")
    for token, i in sorted(main.items(), key=lambda item: item[1]):
        j = draft.get(token)
        if j != i:
            where = "is not in the draft's vocabulary" if j is None else f"is id {j} in the draft {draft_path}"
            return f"{sizes}token {token!r} is id {i} in the main model {main_path} but {where}"
    token, j = min(((t, j) for t, j in draft.items() if t not in main), key=lambda item: item[1])
    return (f"{sizes}token {token!r} (id {j} in the draft {draft_path}) is not in the main model {main_path}'s "
            "vocabulary")
