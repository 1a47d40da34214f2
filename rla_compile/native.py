"""C code rla ships as source (`rla_compile/csrc/`), built once per source and compiler
flags with the machine's C compiler and loaded with ctypes: no torch headers, so a build
takes about a second. The shared objects are cached in `$RLA_CACHE_DIR` (default
`~/.cache/rla_compile`), named by a hash of the source, the flags and the compiler.

Used by the engine-paired forms (the attention site's `sites/attention/vllm_cpu.py`, the MoE
experts' `experts_vllm_cpu.py`), whose floating-point order must be exactly the one written:
hence `-ffp-contract=off` and no `-ffast-math` (a fused multiply-add is written as `fmaf`, or
as the vector unit's FMA instruction). Built for this CPU (`-march=native`) and with OpenMP
(`-fopenmp`: the runtime torch loaded) where the compiler takes them. Where no compiler is
found, `load` raises `NativeUnavailable` saying what is missing; callers fall back to their
Python form and say so.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

__all__ = ["NativeUnavailable", "load", "cache_dir"]

SOURCES = Path(__file__).parent / "csrc"
# exact IEEE arithmetic in the order written: no contraction into FMAs, no reassociation
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-unsafe-math-optimizations", "-fPIC", "-shared")
# this CPU's vector units: each element's arithmetic is the same IEEE operations in the same
# order (an `fmaf` is one rounding in either build), only several elements run per instruction.
# Measured: the experts' GEMM 10.7x faster (139 -> 13 ms at [16, 2048] x [2048, 1536]), equal
# bit for bit. Left out where the compiler rejects it; the cache key then names the CPU.
TUNED = ("-march=native",)
# OpenMP: a kernel that shares its work out over threads uses the OpenMP runtime torch has
# loaded (libgomp.so.1, by that name: its thread pool, sized by torch.set_num_threads), not a
# pool of its own that would compete with torch's spinning threads for the cores. Left out
# where the compiler has no OpenMP; the kernel then runs serially (its callers split the work).
OPENMP = ("-fopenmp",)
# the builds tried, best first: each optional set of flags is dropped where the compiler refuses it
BUILDS = ((*FLAGS, *TUNED, *OPENMP), (*FLAGS, *TUNED), (*FLAGS, *OPENMP), FLAGS)


class NativeUnavailable(RuntimeError):
    """The C code could not be built or loaded here; the message says why and what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("RLA_CACHE_DIR") or Path.home() / ".cache" / "rla_compile")


def _compiler() -> str:
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not found:
        raise NativeUnavailable("no C compiler found (set CC, or install gcc or clang): rla builds its C kernels "
                                "(rla_compile/csrc) on first use")
    return found


@cache
def load(name: str) -> ctypes.CDLL:
    """The shared object built from `csrc/<name>.c`, building it if it is not cached."""
    source = SOURCES / f"{name}.c"
    if not source.is_file():
        raise NativeUnavailable(f"rla_compile/csrc/{name}.c is missing from this installation")
    compiler = _compiler()
    for flags in BUILDS:
        tuned = all(flag in flags for flag in TUNED)
        key = hashlib.sha256(source.read_bytes() + " ".join((compiler, *flags, _cpu() if tuned else "")).encode())
        target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
        if target.exists():
            return ctypes.CDLL(str(target))
        try:
            _build(name, source, compiler, target, flags)
            return ctypes.CDLL(str(target))
        except OSError as error:  # an unwritable cache directory, a full disk
            raise NativeUnavailable(f"building rla_compile/csrc/{name}.c into {target.parent} failed ({error}); "
                                    "set RLA_CACHE_DIR to a writable directory") from None
        except NativeUnavailable:
            if flags == FLAGS:
                raise
    raise AssertionError("unreachable")


def _cpu() -> str:
    """What a build for this CPU's vector units depends on: its architecture and, on Linux, its
    feature flags (a cache directory shared between machines keeps one build per CPU kind)."""
    import platform

    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def _build(name: str, source: Path, compiler: str, target: Path, flags=FLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        try:
            done = subprocess.run([compiler, *flags, "-o", str(built), str(source), "-lm"],
                                  capture_output=True, text=True)
        except OSError as error:
            raise NativeUnavailable(f"building rla_compile/csrc/{name}.c failed: cannot run the C compiler "
                                    f"{compiler!r} ({error.strerror}); set CC to a working gcc or clang") from None
        if done.returncode:
            raise NativeUnavailable(f"building rla_compile/csrc/{name}.c with {compiler} failed:\n"
                                    f"{done.stderr[-2000:]}")
        os.replace(built, target)  # atomic: concurrent builders each write a whole file
