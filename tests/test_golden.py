"""Golden text of each site's rewritten graph, printed by rla's own stable printer.
Regenerate with EXPECTTEST_ACCEPT=1 after an intended change, and read the diff."""

from __future__ import annotations

import expecttest
import torch

import rla_compile
from site_cases import CASES

BY_NAME = {c.name: c for c in CASES}


def _after(name: str) -> str:
    case = BY_NAME[name]
    return rla_compile.align_function(case.fn, *case.inputs(torch.bfloat16)).after


class GoldenGraphs(expecttest.TestCase):
    def test_rmsnorm(self):
        self.assertExpectedInline(_after("norm_llama"), """\
%arg0_1: bf16[2, 16, 64] = input
%arg1_1: bf16[64] = input
%arg0_1_fp32: fp32[2, 16, 64] = aten._to_copy.default(%arg0_1, dtype=fp32)
%pow_1: fp32[2, 16, 64] = aten.pow.Tensor_Scalar(%arg0_1_fp32, 2)
%mean: fp32[2, 16, 1] = aten.mean.dim(%pow_1, [-1], True)
%add: fp32[2, 16, 1] = aten.add.Tensor(%mean, 1e-06)
%rsqrt: fp32[2, 16, 1] = aten.rsqrt.default(%add)
%mul: fp32[2, 16, 64] = aten.mul.Tensor(%arg0_1_fp32, %rsqrt)
%arg1_1_fp32: fp32[64] = aten._to_copy.default(%arg1_1, dtype=fp32)
%mul_1: fp32[2, 16, 64] = aten.mul.Tensor(%arg1_1_fp32, %mul)
%mul_1_rounded: bf16[2, 16, 64] = aten._to_copy.default(%mul_1, dtype=bf16)  # rla: round rmsnorm
return [%mul_1_rounded]""")

    def test_residual_rmsnorm(self):
        self.assertExpectedInline(_after("residual_norm_hf"), """\
%arg0_1: bf16[2, 16, 64] = input
%arg1_1: bf16[2, 16, 64] = input
%arg2_1: bf16[64] = input
%arg0_1_fp32: fp32[2, 16, 64] = aten._to_copy.default(%arg0_1, dtype=fp32)
%arg1_1_fp32: fp32[2, 16, 64] = aten._to_copy.default(%arg1_1, dtype=fp32)
%add: fp32[2, 16, 64] = aten.add.Tensor(%arg0_1_fp32, %arg1_1_fp32)
%add_rounded: bf16[2, 16, 64] = aten._to_copy.default(%add, dtype=bf16)  # rla: round residual_rmsnorm
%pow_1: fp32[2, 16, 64] = aten.pow.Tensor_Scalar(%add, 2)
%mean: fp32[2, 16, 1] = aten.mean.dim(%pow_1, [-1], True)
%add_1: fp32[2, 16, 1] = aten.add.Tensor(%mean, 1e-06)
%rsqrt: fp32[2, 16, 1] = aten.rsqrt.default(%add_1)
%mul: fp32[2, 16, 64] = aten.mul.Tensor(%add, %rsqrt)
%arg2_1_fp32: fp32[64] = aten._to_copy.default(%arg2_1, dtype=fp32)
%mul_1: fp32[2, 16, 64] = aten.mul.Tensor(%arg2_1_fp32, %mul)
%mul_1_rounded: bf16[2, 16, 64] = aten._to_copy.default(%mul_1, dtype=bf16)  # rla: round residual_rmsnorm
return [%add_rounded, %mul_1_rounded]""")

    def test_swiglu_fused(self):
        self.assertExpectedInline(_after("glu_fused_chunk"), """\
%arg0_1: bf16[2, 16, 256] = input
%chunk = aten.chunk.default(%arg0_1, 2, -1)
%getitem: bf16[2, 16, 128] = getitem(%chunk, 0)
%getitem_1: bf16[2, 16, 128] = getitem(%chunk, 1)
%getitem_fp32: fp32[2, 16, 128] = aten._to_copy.default(%getitem, dtype=fp32)
%silu: fp32[2, 16, 128] = aten.silu.default(%getitem_fp32)
%getitem_1_fp32: fp32[2, 16, 128] = aten._to_copy.default(%getitem_1, dtype=fp32)
%mul: fp32[2, 16, 128] = aten.mul.Tensor(%silu, %getitem_1_fp32)
%mul_rounded: bf16[2, 16, 128] = aten._to_copy.default(%mul, dtype=bf16)  # rla: round swiglu
return [%mul_rounded]""")

    def test_rope_with_fp32_cos_sin(self):
        self.assertExpectedInline(_after("rope_hf_fp32_cos_sin"), """\
%arg0_1: i64[16] = input
%arg1_1: fp32[16] = input
%arg2_1: bf16[2, 4, 16, 32] = input
%arg3_1: bf16[2, 4, 16, 32] = input
%unsqueeze: i64[16, 1] = aten.unsqueeze.default(%arg0_1, 1)
%to: fp32[16, 1] = aten.to.dtype(%unsqueeze, fp32)
%unsqueeze_1: fp32[1, 16] = aten.unsqueeze.default(%arg1_1, 0)
%mul: fp32[16, 16] = aten.mul.Tensor(%to, %unsqueeze_1)
%cat: fp32[16, 32] = aten.cat.default([%mul, %mul], -1)
%cos: fp32[16, 32] = aten.cos.default(%cat)
%sin: fp32[16, 32] = aten.sin.default(%cat)
%arg2_1_fp32: fp32[2, 4, 16, 32] = aten._to_copy.default(%arg2_1, dtype=fp32)
%mul_1: fp32[2, 4, 16, 32] = aten.mul.Tensor(%arg2_1_fp32, %cos)
%slice_1: fp32[2, 4, 16, 16] = aten.slice.Tensor(%arg2_1_fp32, 3, 0, 16)
%slice_2: fp32[2, 4, 16, 16] = aten.slice.Tensor(%arg2_1_fp32, 3, 16, 9223372036854775807)
%neg: fp32[2, 4, 16, 16] = aten.neg.default(%slice_2)
%cat_1: fp32[2, 4, 16, 32] = aten.cat.default([%neg, %slice_1], -1)
%mul_2: fp32[2, 4, 16, 32] = aten.mul.Tensor(%cat_1, %sin)
%add: fp32[2, 4, 16, 32] = aten.add.Tensor(%mul_1, %mul_2)
%add_rounded: bf16[2, 4, 16, 32] = aten._to_copy.default(%add, dtype=bf16)  # rla: round rope
%arg3_1_fp32: fp32[2, 4, 16, 32] = aten._to_copy.default(%arg3_1, dtype=fp32)
%mul_3: fp32[2, 4, 16, 32] = aten.mul.Tensor(%arg3_1_fp32, %cos)
%slice_3: fp32[2, 4, 16, 16] = aten.slice.Tensor(%arg3_1_fp32, 3, 0, 16)
%slice_4: fp32[2, 4, 16, 16] = aten.slice.Tensor(%arg3_1_fp32, 3, 16, 9223372036854775807)
%neg_1: fp32[2, 4, 16, 16] = aten.neg.default(%slice_4)
%cat_2: fp32[2, 4, 16, 32] = aten.cat.default([%neg_1, %slice_3], -1)
%mul_4: fp32[2, 4, 16, 32] = aten.mul.Tensor(%cat_2, %sin)
%add_1: fp32[2, 4, 16, 32] = aten.add.Tensor(%mul_3, %mul_4)
%add_1_rounded: bf16[2, 4, 16, 32] = aten._to_copy.default(%add_1, dtype=bf16)  # rla: round rope
return [%add_rounded, %add_1_rounded]""")

    def test_attention_eager_grouped(self):
        self.assertExpectedInline(_after_with("attn_eager_grouped", sites=["attention"]), """\
%arg0_1: bf16[2, 4, 16, 32] = input
%arg1_1: bf16[2, 2, 16, 32] = input
%arg2_1: bf16[2, 2, 16, 32] = input
%arg3_1: bf16[2, 1, 16, 16] = input
%arg0_1_fp32: fp32[2, 4, 16, 32] = aten._to_copy.default(%arg0_1, dtype=fp32)
%q_scaled: fp32[2, 4, 16, 32] = aten.mul.Tensor(%arg0_1_fp32, 0.1767766952966369)
%arg1_1_fp32: fp32[2, 2, 16, 32] = aten._to_copy.default(%arg1_1, dtype=fp32)
%unsqueeze_default: fp32[2, 2, 1, 16, 32] = aten.unsqueeze.default(%arg1_1_fp32, 2)
%expand_default: fp32[2, 2, 2, 16, 32] = aten.expand.default(%unsqueeze_default, [-1, -1, 2, -1, -1])
%arg1_1_fp32_repeated: fp32[2, 4, 16, 32] = aten.flatten.using_ints(%expand_default, 1, 2)
%arg2_1_fp32: fp32[2, 2, 16, 32] = aten._to_copy.default(%arg2_1, dtype=fp32)
%unsqueeze_default_1: fp32[2, 2, 1, 16, 32] = aten.unsqueeze.default(%arg2_1_fp32, 2)
%expand_default_1: fp32[2, 2, 2, 16, 32] = aten.expand.default(%unsqueeze_default_1, [-1, -1, 2, -1, -1])
%arg2_1_fp32_repeated: fp32[2, 4, 16, 32] = aten.flatten.using_ints(%expand_default_1, 1, 2)
%transpose_int: fp32[2, 4, 32, 16] = aten.transpose.int(%arg1_1_fp32_repeated, -2, -1)
%scores: fp32[2, 4, 16, 16] = aten.matmul.default(%q_scaled, %transpose_int)
%arg3_1_fp32: fp32[2, 1, 16, 16] = aten._to_copy.default(%arg3_1, dtype=fp32)
%add_tensor: fp32[2, 4, 16, 16] = aten.add.Tensor(%scores, %arg3_1_fp32)
%ne_scalar: bool[2, 4, 16, 16] = aten.ne.Scalar(%add_tensor, -inf)
%alive_rows: bool[2, 4, 16, 1] = aten.any.dim(%ne_scalar, -1, True)
%where_scalar_other: fp32[2, 4, 16, 16] = aten.where.ScalarOther(%alive_rows, %add_tensor, 0.0)
%probs: fp32[2, 4, 16, 16] = aten._softmax.default(%where_scalar_other, -1, False)
%where_scalar_other_1: fp32[2, 4, 16, 16] = aten.where.ScalarOther(%alive_rows, %probs, 0.0)
%attention: fp32[2, 4, 16, 32] = aten.matmul.default(%where_scalar_other_1, %arg2_1_fp32_repeated)
%matmul_1_rounded: bf16[2, 4, 16, 32] = aten._to_copy.default(%attention, dtype=bf16)  # rla: round attention
return [%matmul_1_rounded]""")

    def test_attention_sdpa_causal(self):
        self.assertExpectedInline(_after_with("attn_sdpa_causal_gqa", sites=["attention"]), """\
%arg0_1: bf16[2, 4, 16, 32] = input
%arg1_1: bf16[2, 2, 16, 32] = input
%arg2_1: bf16[2, 2, 16, 32] = input
%arg0_1_fp32: fp32[2, 4, 16, 32] = aten._to_copy.default(%arg0_1, dtype=fp32)
%q_scaled: fp32[2, 4, 16, 32] = aten.mul.Tensor(%arg0_1_fp32, 0.1)
%arg1_1_fp32: fp32[2, 2, 16, 32] = aten._to_copy.default(%arg1_1, dtype=fp32)
%unsqueeze_default: fp32[2, 2, 1, 16, 32] = aten.unsqueeze.default(%arg1_1_fp32, 2)
%expand_default: fp32[2, 2, 2, 16, 32] = aten.expand.default(%unsqueeze_default, [-1, -1, 2, -1, -1])
%arg1_1_fp32_repeated: fp32[2, 4, 16, 32] = aten.flatten.using_ints(%expand_default, 1, 2)
%arg2_1_fp32: fp32[2, 2, 16, 32] = aten._to_copy.default(%arg2_1, dtype=fp32)
%unsqueeze_default_1: fp32[2, 2, 1, 16, 32] = aten.unsqueeze.default(%arg2_1_fp32, 2)
%expand_default_1: fp32[2, 2, 2, 16, 32] = aten.expand.default(%unsqueeze_default_1, [-1, -1, 2, -1, -1])
%arg2_1_fp32_repeated: fp32[2, 4, 16, 32] = aten.flatten.using_ints(%expand_default_1, 1, 2)
%transpose_int: fp32[2, 4, 32, 16] = aten.transpose.int(%arg1_1_fp32_repeated, -2, -1)
%scores: fp32[2, 4, 16, 16] = aten.matmul.default(%q_scaled, %transpose_int)
%ones_default: bool[16, 16] = aten.ones.default([16, 16], dtype=bool, device=device)
%triu_default: bool[16, 16] = aten.triu.default(%ones_default, 1)
%masked_fill_scalar: fp32[2, 4, 16, 16] = aten.masked_fill.Scalar(%scores, %triu_default, -inf)
%probs: fp32[2, 4, 16, 16] = aten._softmax.default(%masked_fill_scalar, -1, False)
%attention: fp32[2, 4, 16, 32] = aten.matmul.default(%probs, %arg2_1_fp32_repeated)
%scaled_dot_product_attention_rounded: bf16[2, 4, 16, 32] = aten._to_copy.default(%attention, dtype=bf16)  # rla: round attention
return [%scaled_dot_product_attention_rounded]""")


def _after_with(name: str, **options) -> str:
    case = BY_NAME[name]
    return rla_compile.align_function(case.fn, *case.inputs(torch.bfloat16), **options).after
