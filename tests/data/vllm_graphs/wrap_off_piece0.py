"""wrap_off_piece0: piece 0 of a Qwen3 decoder layer split at attention, as a vLLM
post-grad pass receives it (vLLM 0.32.0, torch 2.13.0+cpu, IR torch wrapping
off, fp32 RoPE table). Written by capture.py; do not edit.
"""

# (dtype, shape) per argument; a symbolic size (num_tokens) is a string
INPUTS = [('bfloat16', (128,)), ('bfloat16', ('s26', 128)), ('int', 's26'), ('bfloat16', ('s26', 128)), ('bfloat16', (256, 128)), ('bfloat16', (32,)), ('bfloat16', (32,)), ('float32', (256, 32)), ('int64', ('s26',))]


def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1):
    convert_element_type = torch.ops.prims.convert_element_type.default(arg1_1, torch.float32);  arg1_1 = None
    convert_element_type_1 = torch.ops.prims.convert_element_type.default(arg3_1, torch.float32);  arg3_1 = None
    add_6 = torch.ops.aten.add.Tensor(convert_element_type, convert_element_type_1);  convert_element_type = convert_element_type_1 = None
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(add_6, 2)
    mean = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
    add_19 = torch.ops.aten.add.Tensor(mean, 1e-06);  mean = None
    rsqrt = torch.ops.aten.rsqrt.default(add_19);  add_19 = None
    mul_13 = torch.ops.aten.mul.Tensor(add_6, rsqrt);  rsqrt = None
    convert_element_type_3 = torch.ops.prims.convert_element_type.default(mul_13, torch.bfloat16);  mul_13 = None
    mul_18 = torch.ops.aten.mul.Tensor(convert_element_type_3, arg0_1);  convert_element_type_3 = arg0_1 = None
    permute = torch.ops.aten.permute.default(arg4_1, [1, 0]);  arg4_1 = None
    mm = torch.ops.aten.mm.default(mul_18, permute);  mul_18 = permute = None
    split_with_sizes = torch.ops.aten.split_with_sizes.default(mm, [128, 64, 64], -1);  mm = None
    getitem = split_with_sizes[0]
    getitem_1 = split_with_sizes[1]
    getitem_2 = split_with_sizes[2];  split_with_sizes = None
    convert_element_type_10 = torch.ops.prims.convert_element_type.default(arg7_1, torch.bfloat16);  arg7_1 = None
    index = torch.ops.aten.index.Tensor(convert_element_type_10, [arg8_1]);  convert_element_type_10 = arg8_1 = None
    split = torch.ops.aten.split.Tensor(index, 16, -1);  index = None
    getitem_3 = split[0]
    getitem_4 = split[1];  split = None
    view = torch.ops.aten.reshape.default(getitem, [arg2_1, 4, 32]);  getitem = None
    convert_element_type_6 = torch.ops.prims.convert_element_type.default(view, torch.float32);  view = None
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(convert_element_type_6, 2)
    mean_1 = torch.ops.aten.mean.dim(pow_2, [-1], True);  pow_2 = None
    add_63 = torch.ops.aten.add.Tensor(mean_1, 1e-06);  mean_1 = None
    rsqrt_1 = torch.ops.aten.rsqrt.default(add_63);  add_63 = None
    mul_41 = torch.ops.aten.mul.Tensor(convert_element_type_6, rsqrt_1);  convert_element_type_6 = rsqrt_1 = None
    convert_element_type_7 = torch.ops.prims.convert_element_type.default(mul_41, torch.bfloat16);  mul_41 = None
    mul_46 = torch.ops.aten.mul.Tensor(convert_element_type_7, arg5_1);  convert_element_type_7 = arg5_1 = None
    split_1 = torch.ops.aten.split.Tensor(mul_46, 16, -1);  mul_46 = None
    getitem_5 = split_1[0]
    getitem_6 = split_1[1];  split_1 = None
    view_2 = torch.ops.aten.reshape.default(getitem_1, [arg2_1, 2, 32]);  getitem_1 = None
    convert_element_type_8 = torch.ops.prims.convert_element_type.default(view_2, torch.float32);  view_2 = None
    pow_3 = torch.ops.aten.pow.Tensor_Scalar(convert_element_type_8, 2)
    mean_2 = torch.ops.aten.mean.dim(pow_3, [-1], True);  pow_3 = None
    add_103 = torch.ops.aten.add.Tensor(mean_2, 1e-06);  mean_2 = None
    rsqrt_2 = torch.ops.aten.rsqrt.default(add_103);  add_103 = None
    mul_63 = torch.ops.aten.mul.Tensor(convert_element_type_8, rsqrt_2);  convert_element_type_8 = rsqrt_2 = None
    convert_element_type_9 = torch.ops.prims.convert_element_type.default(mul_63, torch.bfloat16);  mul_63 = None
    mul_68 = torch.ops.aten.mul.Tensor(convert_element_type_9, arg6_1);  convert_element_type_9 = arg6_1 = None
    split_2 = torch.ops.aten.split.Tensor(mul_68, 16, -1);  mul_68 = None
    getitem_7 = split_2[0]
    getitem_8 = split_2[1];  split_2 = None
    unsqueeze = torch.ops.aten.unsqueeze.default(getitem_3, -2)
    mul_92 = torch.ops.aten.mul.Tensor(getitem_5, unsqueeze)
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(getitem_4, -2)
    mul_95 = torch.ops.aten.mul.Tensor(getitem_6, unsqueeze_1)
    sub_47 = torch.ops.aten.sub.Tensor(mul_92, mul_95);  mul_92 = mul_95 = None
    mul_100 = torch.ops.aten.mul.Tensor(getitem_6, unsqueeze);  getitem_6 = unsqueeze = None
    mul_103 = torch.ops.aten.mul.Tensor(getitem_5, unsqueeze_1);  getitem_5 = unsqueeze_1 = None
    add_182 = torch.ops.aten.add.Tensor(mul_100, mul_103);  mul_100 = mul_103 = None
    cat = torch.ops.aten.cat.default([sub_47, add_182], -1);  sub_47 = add_182 = None
    view_5 = torch.ops.aten.reshape.default(cat, [arg2_1, 128]);  cat = None
    unsqueeze_2 = torch.ops.aten.unsqueeze.default(getitem_3, -2);  getitem_3 = None
    mul_131 = torch.ops.aten.mul.Tensor(getitem_7, unsqueeze_2)
    unsqueeze_3 = torch.ops.aten.unsqueeze.default(getitem_4, -2);  getitem_4 = None
    mul_134 = torch.ops.aten.mul.Tensor(getitem_8, unsqueeze_3)
    sub_64 = torch.ops.aten.sub.Tensor(mul_131, mul_134);  mul_131 = mul_134 = None
    mul_139 = torch.ops.aten.mul.Tensor(getitem_8, unsqueeze_2);  getitem_8 = unsqueeze_2 = None
    mul_142 = torch.ops.aten.mul.Tensor(getitem_7, unsqueeze_3);  getitem_7 = unsqueeze_3 = None
    add_244 = torch.ops.aten.add.Tensor(mul_139, mul_142);  mul_139 = mul_142 = None
    cat_1 = torch.ops.aten.cat.default([sub_64, add_244], -1);  sub_64 = add_244 = None
    view_7 = torch.ops.aten.reshape.default(cat_1, [arg2_1, 64]);  cat_1 = None
    empty = torch.ops.aten.empty.memory_format([arg2_1, 128], dtype = torch.bfloat16, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  arg2_1 = None
    convert_element_type_2 = torch.ops.prims.convert_element_type.default(add_6, torch.bfloat16);  add_6 = None
    return (view_5, view_7, getitem_2, empty, convert_element_type_2)
