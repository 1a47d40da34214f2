"""The attention site's `vllm_triton` form where no vLLM runs (the kernel itself, under Triton's
interpreter against the engine's own call: tests/test_vllm.py): which tokens of a padded batch
it hands the kernel, the masks it refuses, and what it says without vLLM."""

import importlib.util
import math

import pytest
import torch

from rla_compile.sites.attention import vllm_triton

from support.vllm_triton_interpreter import hf_mask


@pytest.mark.parametrize("padding", [[(0, 12)], [(3, 12), (0, 12), (0, 7)], [(0, 0)]])
def test_spans_are_each_sequences_tokens(padding):
    """HF's causal masks with left and right padding (its unmasked padding rows included): the
    tokens each sequence holds, which the engine would hold; none for an all-padding row."""
    mask = hf_mask(len(padding), 12, padding)
    want = [(first, end) if end > first else (0, 0) for first, end in padding]
    assert vllm_triton.spans(mask, len(padding), 12) == want
    assert vllm_triton.spans(None, 2, 12) == [(0, 12), (0, 12)]


def test_a_mask_the_kernel_does_not_compute_is_refused_with_the_way_out():
    """An additive bias other than 0 on kept keys (ALiBi-like) and a sliding window are not what
    TRITON_ATTN computes for a causal LM without them: refused, naming the contract form."""
    sloped = hf_mask(1, 8, [(0, 8)]) + torch.arange(8.0)[None, None, None, :] * 0.1
    window = hf_mask(1, 8, [(0, 8)])
    window[..., 6:, :2] = torch.finfo(torch.float32).min
    for mask in (sloped, window):
        with pytest.raises(ValueError, match="not causal with 0 on those tokens.*rounding 'nearest'"):
            vllm_triton.spans(mask, 1, 8)


def test_packed_is_vllms_prefill_layout():
    """Tokens packed one sequence after another, keys in paged blocks read back through the
    block table: every live token's q, k and v where the kernel reads it."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 21, 8, generator=gen), torch.randn(3, 2, 21, 8, generator=gen), torch.randn(3, 2, 21, 8, generator=gen)
    seqs = [(0, 21), (0, 0), (5, 18)]
    queries, keys, values, table, starts, lengths, live = vllm_triton.packed(q, k, v, seqs)
    assert [b for b, _, _ in live] == [0, 2] and lengths.tolist() == [21, 13] and starts.tolist() == [0, 21, 34]
    for row, (b, first, end) in enumerate(live):
        assert torch.equal(queries[starts[row]:starts[row + 1]], q[b, :, first:end].transpose(0, 1))
        for cache, x in ((keys, k), (values, v)):
            blocks = table[row, :math.ceil((end - first) / vllm_triton.BLOCK)].long()
            assert torch.equal(cache[blocks].flatten(0, 1)[:end - first], x[b, :, first:end].transpose(0, 1))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_form_says_what_to_install():
    q = torch.randn(1, 2, 4, 8).bfloat16()
    with pytest.raises(RuntimeError, match="Install the vllm your engine runs"):
        torch.ops.rla.vllm_triton_attention(q, q, q, 0.35, None)


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left-padded"])
def test_the_cuda_backward_is_sdpas_gradient_of_the_same_attention(padded):
    """`sdpa_backward`, the form's backward on CUDA (flash or memory-efficient there; SDPA's math
    kernel on this CPU), gives the contract's gradients to bf16's precision: grouped heads
    summed back per KV head, the causal flag or HF's padding mask."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 16, generator=gen).bfloat16()
    k, v = (torch.randn(2, 2, 24, 16, generator=gen).bfloat16() for _ in range(2))
    grad = torch.randn(2, 4, 24, 16, generator=gen)
    mask = hf_mask(2, 24, [(0, 24), (5, 24)]) if padded else None
    got = vllm_triton.sdpa_backward(grad, q, k, v, 0.25, mask)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    scores = (leaves[0] * 0.25) @ leaves[1].repeat_interleave(2, 1).transpose(-1, -2)
    scores = scores + mask.double() if padded else scores.masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), -math.inf)
    (torch.softmax(scores, -1) @ leaves[2].repeat_interleave(2, 1)).backward(grad.double())
    for mine, ref in zip(got, leaves):
        assert mine.dtype == torch.bfloat16 and mine.shape == ref.shape
        assert float((mine.double() - ref.grad).norm() / ref.grad.norm()) < 0.01
