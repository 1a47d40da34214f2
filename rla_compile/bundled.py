"""The low-entropy model rla_compile ships: the embedded default of `rla-compile demo` and
`rla-compile mismatch` (no download).

A 4-layer Qwen3 over bytes (token id = byte value; 2/3 are BOS/EOS), trained by
`scripts/train_default_model.py` on the Python standard library's source, saved in bf16 with
`save_pretrained` (~2 MB). Its byte tokenizer (`tokenizer()`, written next to the weights by
`save_tokenizer()`) lets stacks that insist on one — TRL, vLLM without
`skip_tokenizer_init` — load the directory as any HF model. Trained, its next-token distributions are peaked like a real LLM's:
rounding noise moves its logprobs the way it moves a real model's, which a random model's flat
distributions hide.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["MODEL_DIR", "cast_note", "check_model_dir", "decode", "encode", "load", "prompts", "save_tokenizer",
           "saved_dtype", "tokenizer"]

MODEL_DIR = Path(__file__).resolve().parent / "data" / "qwen3-bytes"


def load(dtype: torch.dtype | str = "bfloat16", model_dir: str | Path = MODEL_DIR):
    """The model in `model_dir` (default: the shipped one), eager attention, in `dtype` (a
    torch dtype or its name), whatever dtype its weights were saved in (`cast_note` says so)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as error:
        raise ImportError("loading the model needs transformers: pip install 'rla_compile[hf]'") from error
    path = check_model_dir(model_dir)
    with _quiet_loading():  # one "Loading weights" bar per stack, a dozen per ablation, say nothing
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                    local_files_only=True)


def check_model_dir(model_dir: str | Path, default: str = "the shipped model") -> Path:
    """`model_dir` as a Path if it holds a saved model, else a FileNotFoundError that says what
    to pass (checked before any slow step, and by `load`); `default` is what passing nothing gives."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        missing = "does not exist" if not path.exists() else "is not a model directory (no config.json)"
        raise FileNotFoundError(f"{path} {missing}: pass a directory written by save_pretrained, or nothing for "
                                f"{default}")
    return path


def config_of(model_dir: str | Path) -> SimpleNamespace:
    """`model_dir`'s config.json as attributes (what `Site.in_model` reads: e.g. its number of
    experts), without building a transformers config."""
    return SimpleNamespace(**json.loads((check_model_dir(model_dir) / "config.json").read_text()))


def saved_dtype(model_dir: str | Path) -> str | None:
    """The dtype the weights in `model_dir` were saved in, as its config.json records it
    ("dtype"; "torch_dtype" before transformers 5); None when it does not say."""
    config = json.loads((check_model_dir(model_dir) / "config.json").read_text())
    saved = config.get("dtype") or config.get("torch_dtype")
    return str(saved).removeprefix("torch.") if saved else None


def cast_note(model_dir: str | Path, dtypes: tuple[str, ...] | set[str] = ("bfloat16",)) -> str | None:
    """One line for the progress stream when the model runs in `dtypes` other than the one its
    weights were saved in (every stack loads the weights in its own dtype: bf16 unless its
    label says `:float32`); None when they agree or the config does not say."""
    saved = saved_dtype(model_dir)
    other = sorted(set(dtypes) - {saved}) if saved else []
    if not other:
        return None
    rl = " as both stacks would in RL" if other == ["bfloat16"] else ""
    return f"model weights are {saved}; running in {' and '.join(other)}{rl}"


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
    if n < 1 or length < 1:
        raise ValueError(f"prompts(n={n}, length={length}): need at least 1 prompt of at least 1 token")
    text = (MODEL_DIR / "held_out.txt").read_bytes()
    starts = [i + 1 for i, b in enumerate(text) if b == ord("\n") and text[i + 1 : i + 2].strip()]
    step = max(1, len(starts) // n)
    chosen = [s for s in starts[::step] if s + length <= len(text)][:n]
    if len(chosen) < n:
        raise ValueError(f"the held-out text has room for {len(chosen)} prompts of {length} tokens, not {n}")
    return [list(text[s : s + length]) for s in chosen]


BOS, EOS = 2, 3  # the model's config.json


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte: printable Latin-1 bytes map to themselves, the
    rest to code points from 256 on (the table `tokenizers`' ByteLevel pre-tokenizer uses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer():
    """The shipped model's tokenizer: one token per byte, id = byte value (`encode`/`decode` as
    an HF `PreTrainedTokenizerFast`). A `tokenizers` BPE without merges over GPT-2's
    byte-to-unicode alphabet, ByteLevel pre-tokenizer and decoder without the regex split;
    BOS/EOS/PAD are bytes 2/3/3 as in the model's config."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError as error:
        raise ImportError("the byte tokenizer needs transformers: pip install 'rla_compile[hf]'") from error
    table = _byte_to_unicode()
    vocab = {char: b for b, char in table.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=table[BOS], eos_token=table[EOS], pad_token=table[EOS],
        model_max_length=512,  # max_position_embeddings
    )


def save_tokenizer(model_dir: str | Path = MODEL_DIR) -> list[Path]:
    """Write `tokenizer()` next to a model (`tokenizer.json`, `tokenizer_config.json`); the
    shipped model has them already (`tests/test_rl.py` checks they equal this builder's)."""
    return [Path(p) for p in tokenizer().save_pretrained(model_dir) if Path(p).name.startswith("tokenizer")]
