"""Progress lines for slow steps (the demo, `rla-compile mismatch`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

__all__ = ["timed"]


@contextmanager
def timed(say: Callable[[str], None], what: str):
    """Progress for a slow step: what is happening, then how long it took."""
    say(f"... {what}")
    start = time.perf_counter()
    yield
    say(f"    done in {time.perf_counter() - start:.1f} s")
