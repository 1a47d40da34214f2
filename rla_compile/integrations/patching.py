"""The one way rla's integrations change a library's attribute or the environment, and the way back.

    patch(EngineArgs, "create_engine_config", wrapper)   # records what EngineArgs had
    setenv("VLLM_CPU_ATTN_SPLIT_KV", "0")                # records the variable as it was (or unset)
    undo_all()                                           # every change undone, newest first

Each patch records the attribute as it was in the owner's own `__dict__` (or that the owner had
none and inherited it), so undoing restores exactly that: `Trainer.__init__ is original` again,
and an inherited attribute is deleted rather than copied down. Patching an attribute rla already
patched replaces rla's value and keeps the first record: patches never stack, and `undo_all()`
still restores the library's own.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["patch", "original", "setenv", "undo_all"]

_ABSENT = object()
_ENVIRON = object()  # the owner under which environment variables are recorded
# (owner, name) -> (owner.__dict__'s value before rla's first patch, or _ABSENT; the attribute as
# read then, inherited included), in the order first patched
_originals: dict[tuple[Any, str], tuple[Any, Any]] = {}


def original(owner: Any, name: str, *default: Any) -> Any:
    """`owner.name` as the library has it: before rla's first patch, or now when unpatched
    (`default`, when given, for an attribute the library lacks)."""
    found = _originals.get((owner, name))
    return getattr(owner, name, *default) if found is None else found[1]


def patch(owner: Any, name: str, new: Any) -> None:
    """Set `owner.name = new`, remembering what `owner` held before rla's first patch of it."""
    key = (owner, name)
    if key not in _originals:
        _originals[key] = (vars(owner).get(name, _ABSENT), getattr(owner, name, _ABSENT))
    setattr(owner, name, new)


def setenv(name: str, value: str) -> None:
    """Set the environment variable `name`, remembering its value before rla's first change of it."""
    key = (_ENVIRON, name)
    if key not in _originals:
        before = os.environ.get(name, _ABSENT)
        _originals[key] = (before, before)
    os.environ[name] = value


def undo_all() -> None:
    """Restore every patched attribute and environment variable, newest first; a no-op when
    nothing is patched."""
    while _originals:
        (owner, name), (value, _) = _originals.popitem()
        if owner is _ENVIRON:
            if value is _ABSENT:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        elif value is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, value)
