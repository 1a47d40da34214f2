"""wrap_on_piece1: piece 1 of a Qwen3 decoder layer split at attention, as a vLLM
post-grad pass receives it (vLLM 0.32.0, torch 2.13.0+cpu, IR torch wrapping
on, fp32 RoPE table). Written by capture.py; do not edit.
"""

# (dtype, shape) per argument; a symbolic size (num_tokens) is a string
INPUTS = [('bfloat16', ('s26', 128)), ('int', 's26'), ('bfloat16', (128, 128)), ('bfloat16', (128,)), ('bfloat16', ('s26', 128)), ('bfloat16', (512, 128)), ('bfloat16', (128, 256))]


def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1):
    permute = torch.ops.aten.permute.default(arg2_1, [1, 0]);  arg2_1 = None
    mm = torch.ops.aten.mm.default(arg0_1, permute);  arg0_1 = permute = None
    fused_add_rms_norm = torch.ops.vllm_ir.fused_add_rms_norm.default(mm, arg4_1, arg3_1, 1e-06);  mm = arg4_1 = arg3_1 = None
    getitem = fused_add_rms_norm[0]
    getitem_1 = fused_add_rms_norm[1];  fused_add_rms_norm = None
    permute_1 = torch.ops.aten.permute.default(arg5_1, [1, 0]);  arg5_1 = None
    mm_1 = torch.ops.aten.mm.default(getitem, permute_1);  getitem = permute_1 = None
    slice_1 = torch.ops.aten.slice.Tensor(mm_1, 1, 0, 256)
    convert_element_type_4 = torch.ops.prims.convert_element_type.default(slice_1, torch.float32);  slice_1 = None
    neg = torch.ops.aten.neg.default(convert_element_type_4)
    exp = torch.ops.aten.exp.default(neg);  neg = None
    add_15 = torch.ops.aten.add.Tensor(exp, 1);  exp = None
    div = torch.ops.aten.div.Tensor(convert_element_type_4, add_15);  convert_element_type_4 = add_15 = None
    convert_element_type_5 = torch.ops.prims.convert_element_type.default(div, torch.bfloat16);  div = None
    slice_2 = torch.ops.aten.slice.Tensor(mm_1, 1, 256, 9223372036854775807);  mm_1 = None
    mul_14 = torch.ops.aten.mul.Tensor(convert_element_type_5, slice_2);  convert_element_type_5 = slice_2 = None
    permute_2 = torch.ops.aten.permute.default(arg6_1, [1, 0]);  arg6_1 = None
    mm_2 = torch.ops.aten.mm.default(mul_14, permute_2);  mul_14 = permute_2 = None
    return (mm_2, getitem_1)
