"""wrap_off_piece1: piece 1 of a Qwen3 decoder layer split at attention, as a vLLM
post-grad pass receives it (vLLM 0.32.0, torch 2.13.0+cpu, IR torch wrapping
off, fp32 RoPE table). Written by capture.py; do not edit.
"""

# (dtype, shape) per argument; a symbolic size (num_tokens) is a string
INPUTS = [('bfloat16', ('s26', 128)), ('int', 's26'), ('bfloat16', (128, 128)), ('bfloat16', (128,)), ('bfloat16', ('s26', 128)), ('bfloat16', (512, 128)), ('bfloat16', (128, 256))]


def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1):
    permute = torch.ops.aten.permute.default(arg2_1, [1, 0]);  arg2_1 = None
    mm = torch.ops.aten.mm.default(arg0_1, permute);  arg0_1 = permute = None
    convert_element_type_2 = torch.ops.prims.convert_element_type.default(mm, torch.float32);  mm = None
    convert_element_type_3 = torch.ops.prims.convert_element_type.default(arg4_1, torch.float32);  arg4_1 = None
    add_9 = torch.ops.aten.add.Tensor(convert_element_type_2, convert_element_type_3);  convert_element_type_2 = convert_element_type_3 = None
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(add_9, 2)
    mean = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
    add_22 = torch.ops.aten.add.Tensor(mean, 1e-06);  mean = None
    rsqrt = torch.ops.aten.rsqrt.default(add_22);  add_22 = None
    mul_15 = torch.ops.aten.mul.Tensor(add_9, rsqrt);  rsqrt = None
    convert_element_type_5 = torch.ops.prims.convert_element_type.default(mul_15, torch.bfloat16);  mul_15 = None
    mul_20 = torch.ops.aten.mul.Tensor(convert_element_type_5, arg3_1);  convert_element_type_5 = arg3_1 = None
    permute_1 = torch.ops.aten.permute.default(arg5_1, [1, 0]);  arg5_1 = None
    mm_1 = torch.ops.aten.mm.default(mul_20, permute_1);  mul_20 = permute_1 = None
    slice_1 = torch.ops.aten.slice.Tensor(mm_1, 1, 0, 256)
    convert_element_type_8 = torch.ops.prims.convert_element_type.default(slice_1, torch.float32);  slice_1 = None
    neg = torch.ops.aten.neg.default(convert_element_type_8)
    exp = torch.ops.aten.exp.default(neg);  neg = None
    add_44 = torch.ops.aten.add.Tensor(exp, 1);  exp = None
    div = torch.ops.aten.div.Tensor(convert_element_type_8, add_44);  convert_element_type_8 = add_44 = None
    convert_element_type_9 = torch.ops.prims.convert_element_type.default(div, torch.bfloat16);  div = None
    slice_2 = torch.ops.aten.slice.Tensor(mm_1, 1, 256, 9223372036854775807);  mm_1 = None
    mul_31 = torch.ops.aten.mul.Tensor(convert_element_type_9, slice_2);  convert_element_type_9 = slice_2 = None
    permute_2 = torch.ops.aten.permute.default(arg6_1, [1, 0]);  arg6_1 = None
    mm_2 = torch.ops.aten.mm.default(mul_31, permute_2);  mul_31 = permute_2 = None
    convert_element_type_4 = torch.ops.prims.convert_element_type.default(add_9, torch.bfloat16);  add_9 = None
    return (mm_2, convert_element_type_4)
