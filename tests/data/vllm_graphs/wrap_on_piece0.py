"""wrap_on_piece0: piece 0 of a Qwen3 decoder layer split at attention, as a vLLM
post-grad pass receives it (vLLM 0.32.0, torch 2.13.0+cpu, IR torch wrapping
on, fp32 RoPE table). Written by capture.py; do not edit.
"""

# (dtype, shape) per argument; a symbolic size (num_tokens) is a string
INPUTS = [('bfloat16', (128,)), ('bfloat16', ('s26', 128)), ('int', 's26'), ('bfloat16', ('s26', 128)), ('bfloat16', (256, 128)), ('bfloat16', (32,)), ('bfloat16', (32,)), ('float32', (256, 32)), ('int64', ('s26',))]


def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1):
    fused_add_rms_norm = torch.ops.vllm_ir.fused_add_rms_norm.default(arg1_1, arg3_1, arg0_1, 1e-06);  arg1_1 = arg3_1 = arg0_1 = None
    getitem = fused_add_rms_norm[0]
    getitem_1 = fused_add_rms_norm[1];  fused_add_rms_norm = None
    permute = torch.ops.aten.permute.default(arg4_1, [1, 0]);  arg4_1 = None
    mm = torch.ops.aten.mm.default(getitem, permute);  getitem = permute = None
    split_with_sizes = torch.ops.aten.split_with_sizes.default(mm, [128, 64, 64], -1);  mm = None
    getitem_2 = split_with_sizes[0]
    getitem_3 = split_with_sizes[1]
    getitem_4 = split_with_sizes[2];  split_with_sizes = None
    convert_element_type_2 = torch.ops.prims.convert_element_type.default(arg7_1, torch.bfloat16);  arg7_1 = None
    index = torch.ops.aten.index.Tensor(convert_element_type_2, [arg8_1]);  convert_element_type_2 = arg8_1 = None
    split = torch.ops.aten.split.Tensor(index, 16, -1);  index = None
    getitem_5 = split[0]
    getitem_6 = split[1];  split = None
    view = torch.ops.aten.reshape.default(getitem_2, [arg2_1, 4, 32]);  getitem_2 = None
    rms_norm = torch.ops.vllm_ir.rms_norm.default(view, arg5_1, 1e-06);  view = arg5_1 = None
    split_1 = torch.ops.aten.split.Tensor(rms_norm, 16, -1);  rms_norm = None
    getitem_7 = split_1[0]
    getitem_8 = split_1[1];  split_1 = None
    view_2 = torch.ops.aten.reshape.default(getitem_3, [arg2_1, 2, 32]);  getitem_3 = None
    rms_norm_1 = torch.ops.vllm_ir.rms_norm.default(view_2, arg6_1, 1e-06);  view_2 = arg6_1 = None
    split_2 = torch.ops.aten.split.Tensor(rms_norm_1, 16, -1);  rms_norm_1 = None
    getitem_9 = split_2[0]
    getitem_10 = split_2[1];  split_2 = None
    unsqueeze = torch.ops.aten.unsqueeze.default(getitem_5, -2)
    mul_43 = torch.ops.aten.mul.Tensor(getitem_7, unsqueeze)
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(getitem_6, -2)
    mul_46 = torch.ops.aten.mul.Tensor(getitem_8, unsqueeze_1)
    sub_24 = torch.ops.aten.sub.Tensor(mul_43, mul_46);  mul_43 = mul_46 = None
    mul_51 = torch.ops.aten.mul.Tensor(getitem_8, unsqueeze);  getitem_8 = unsqueeze = None
    mul_54 = torch.ops.aten.mul.Tensor(getitem_7, unsqueeze_1);  getitem_7 = unsqueeze_1 = None
    add_95 = torch.ops.aten.add.Tensor(mul_51, mul_54);  mul_51 = mul_54 = None
    cat = torch.ops.aten.cat.default([sub_24, add_95], -1);  sub_24 = add_95 = None
    view_5 = torch.ops.aten.reshape.default(cat, [arg2_1, 128]);  cat = None
    unsqueeze_2 = torch.ops.aten.unsqueeze.default(getitem_5, -2);  getitem_5 = None
    mul_82 = torch.ops.aten.mul.Tensor(getitem_9, unsqueeze_2)
    unsqueeze_3 = torch.ops.aten.unsqueeze.default(getitem_6, -2);  getitem_6 = None
    mul_85 = torch.ops.aten.mul.Tensor(getitem_10, unsqueeze_3)
    sub_41 = torch.ops.aten.sub.Tensor(mul_82, mul_85);  mul_82 = mul_85 = None
    mul_90 = torch.ops.aten.mul.Tensor(getitem_10, unsqueeze_2);  getitem_10 = unsqueeze_2 = None
    mul_93 = torch.ops.aten.mul.Tensor(getitem_9, unsqueeze_3);  getitem_9 = unsqueeze_3 = None
    add_157 = torch.ops.aten.add.Tensor(mul_90, mul_93);  mul_90 = mul_93 = None
    cat_1 = torch.ops.aten.cat.default([sub_41, add_157], -1);  sub_41 = add_157 = None
    view_7 = torch.ops.aten.reshape.default(cat_1, [arg2_1, 64]);  cat_1 = None
    empty = torch.ops.aten.empty.memory_format([arg2_1, 128], dtype = torch.bfloat16, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  arg2_1 = None
    return (view_5, view_7, getitem_4, empty, getitem_1)
