"""One training step's results, by name, and their comparison: the guard against lost gradients.

`step` returns the logits and the gradient of every trainable parameter that got one, keyed by
parameter name; `mismatches` first checks that both runs gave gradients to the same
parameters (a parameter whose gradient silently went missing fails here, by name), then
counts the elements that differ. Every model test compares through these.
"""

from __future__ import annotations

import torch


def step(model, ids, backend=None, hf: bool = True, cotangent_seed: int = 1) -> dict[str, torch.Tensor]:
    """{"logits": ..., name: gradient, ...} for one forward and backward with a fixed cotangent.
    `backend`: compile with it (None: eager). `hf`: call as an HF causal LM (`.logits`)."""
    forward = torch.compile(model, backend=backend) if backend is not None else model
    out = forward(ids, use_cache=False) if hf else forward(ids)
    logits = out.logits if hf else out
    cotangent = torch.randn(logits.shape, generator=torch.Generator().manual_seed(cotangent_seed)).to(logits.dtype)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # PEFT: the adapters only
    grads = torch.autograd.grad(logits, [p for _, p in named], cotangent, allow_unused=True)
    result = {"logits": logits.detach()}
    result.update({name.replace("_orig_mod.", ""): g for (name, _), g in zip(named, grads, strict=True) if g is not None})
    return result


def assert_same_parameters(got: dict, expected: dict) -> None:
    lost, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    assert not lost and not extra, f"gradients lost for {lost}, gained for {extra}"


def mismatches(got: dict, expected: dict) -> int:
    """Elements that differ over logits and every gradient; the parameters with a gradient
    must be the same in both."""
    assert_same_parameters(got, expected)
    return sum(int((got[k] != expected[k]).sum()) for k in expected)
