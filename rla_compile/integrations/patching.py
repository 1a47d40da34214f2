"""The one way rla's integrations change a library's attribute, and the way back.

    patch(EngineArgs, "create_engine_config", wrapper)   # records what EngineArgs had
    undo_all()                                           # every patch undone, newest first

Each patch records the attribute as it was in the owner's own `__dict__` (or that the owner had
none and inherited it), so undoing restores exactly that: `Trainer.__init__ is original` again,
and an inherited attribute is deleted rather than copied down. Patching an attribute rla already
patched replaces rla's value and keeps the first record: patches never stack, and `undo_all()`
still restores the library's own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["patch", "original", "undo_all"]

_ABSENT = object()
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


def undo_all() -> None:
    """Restore every patched attribute, newest first; a no-op when nothing is patched."""
    while _originals:
        (owner, name), (value, _) = _originals.popitem()
        if value is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, value)
