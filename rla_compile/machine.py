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


def machine(device: str = "cpu") -> dict:
    """CPU model, architecture, cores, torch threads, torch version (and the GPU on CUDA)."""
    info = {"cpu": _cpu_model(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def describe(info: dict) -> str:
    """One line, e.g. 'Intel(R) Xeon(R) ... (x86_64), 2 cores, 2 threads, torch 2.13.0+cpu'."""
    gpu = f", {info['gpu']}" if info.get("gpu") else ""
    cpu = info.get("cpu") or info.get("processor", "?")
    return (f"{cpu} ({info.get('machine', '?')}), {info.get('cpus', '?')} cores, {info.get('threads', '?')} threads, "
            f"torch {info.get('torch', '?')}{gpu}")
