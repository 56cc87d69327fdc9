"""What the CUDA backend derives from an object it does not own, kept on that object.

Some device data belongs to one Weight (or one list of expert Weights) and lives exactly as long as it: the
zero-copy device view of a Weight in host RAM (hostweights.py), the one matrix a fused projection group becomes
(gemv.linear_group), a MoE layer's pointer tables and decode scratch (moe.py), its streamed experts' tables
(stream.HostExperts). It is kept in a dict on the object itself (``derived``), never in a module-level dict keyed
by ``id()``: such a dict is shared by every engine in the process, keeps entries for objects that are gone until
a finalizer runs, and once an id is reused (CPython reuses the address of a freed object) hands one model's data
to another. On the object, it is freed with it, and two engines never see each other's.

``derived`` returns the object's own dict (made on first use), which ``dataclasses.replace`` and ``==`` ignore:
a Weight made from another (Gemma's gate / up halves of one matrix) starts with none. An object that cannot
take attributes (a plain list) cannot carry state: callers key on the first Weight of a list instead.
"""

from __future__ import annotations

ATTR = "_lumen_cuda"


def derived(obj) -> dict:
    """``obj``'s own dict of CUDA state (empty at first)."""
    d = obj.__dict__.get(ATTR)
    if d is None:
        d = obj.__dict__[ATTR] = {}
    return d
