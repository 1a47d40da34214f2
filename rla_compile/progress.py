"""Progress lines for slow steps (the demo, `rla-compile mismatch`). The command line's
convention: progress and diagnostics go to stderr (`say_progress`), results (reports, tables)
to stdout, so `rla-compile mismatch > table.txt` keeps only the results."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import contextmanager

__all__ = ["say_progress", "timed"]


def say_progress(line: str) -> None:
    """One progress or diagnostic line, on stderr, at once."""
    print(line, file=sys.stderr, flush=True)


@contextmanager
def timed(say: Callable[[str], None], what: str):
    """Progress for a slow step: what is happening, then how long it took."""
    say(f"... {what}")
    start = time.perf_counter()
    yield
    say(f"    done in {time.perf_counter() - start:.1f} s")
