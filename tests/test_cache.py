"""Inductor's caches across processes: a changed option changes the key, the same options hit
the cache, and a hit still produces the report and the debug dump (the rewrite runs before
the cache lookup)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).parent / "probes" / "cache_probe.py"
SUPPORT = Path(__file__).parent / "support"


def _run(options: dict, cache_dir: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), PYTHONPATH=str(SUPPORT))
    done = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(options)], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cache_key_follows_options(tmp_path):
    first = _run({}, tmp_path / "cache")
    again = _run({"debug": str(tmp_path / "dump")}, tmp_path / "cache")  # debug is not in the key
    rope_only = _run({"sites": ["rope"]}, tmp_path / "cache")
    pinned = _run({"pin_rounding": True}, tmp_path / "cache")

    assert (first["miss"], first["hit"]) == (1, 0)
    assert (again["miss"], again["hit"]) == (0, 1)  # same options: served from cache ...
    assert again["report"] == first["report"] and again["rewritten"] == 2  # ... report intact
    assert again["out"] == first["out"]
    assert "rewritten rmsnorm=1, swiglu=1" in (tmp_path / "dump" / "index.txt").read_text()  # and the dump
    assert (rope_only["miss"], rope_only["hit"]) == (1, 0)  # different rewrite, different key
    assert rope_only["rewritten"] == 0
    assert (pinned["miss"], pinned["hit"]) == (1, 0)
