"""The low-entropy model rla_compile ships: the embedded default of `rla-compile demo` and
`rla-compile mismatch` (no download).

A 4-layer Qwen3 over bytes (token id = byte value; 2/3 are BOS/EOS), trained by
`scripts/train_default_model.py` on the Python standard library's source, saved in bf16 with
`save_pretrained` (~2 MB). Trained, its next-token distributions are peaked like a real LLM's:
rounding noise moves its logprobs the way it moves a real model's, which a random model's flat
distributions hide.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["MODEL_DIR", "decode", "encode", "load", "prompts"]

MODEL_DIR = Path(__file__).resolve().parent / "data" / "qwen3-bytes"


def load(dtype: torch.dtype = torch.bfloat16, model_dir: str | Path = MODEL_DIR):
    """The model in `model_dir` (default: the shipped one), eager attention, in `dtype`."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as error:
        raise ImportError("loading the model needs transformers: pip install 'rla_compile[hf]'") from error
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json): pass a directory written by "
                                "save_pretrained, or nothing for the shipped model")
    with _quiet_loading():  # one "Loading weights" bar per stack, a dozen per ablation, say nothing
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                    local_files_only=True)


@contextmanager
def _quiet_loading():
    """transformers' progress bars off while loading, then as they were."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def prompts(n: int = 8, length: int = 32) -> list[list[int]]:
    """`n` prompts of `length` byte tokens, cut from held-out text at line starts."""
    text = (MODEL_DIR / "held_out.txt").read_bytes()
    starts = [i + 1 for i, b in enumerate(text) if b == ord("\n") and text[i + 1 : i + 2].strip()]
    step = max(1, len(starts) // n)
    chosen = [s for s in starts[::step] if s + length <= len(text)][:n]
    if len(chosen) < n:
        raise ValueError(f"the held-out text has room for {len(chosen)} prompts of {length} tokens, not {n}")
    return [list(text[s : s + length]) for s in chosen]
