"""Regenerate the captured vLLM graphs in this folder (run with a vLLM install):

    python tests/data/vllm_graphs/capture.py [OUT_DIR]

What a post-grad pass sees on vLLM's GPU path, built on CPU from vLLM's own code: a Qwen3
decoder layer written with vLLM's layers (RMSNorm with fused residual add, per-head q/k
RMSNorm, RotaryEmbedding, SiluAndMul; plain linears) around vLLM's attention op, captured by
Dynamo with num_tokens dynamic, split at attention by vLLM's `split_graph` (VLLM_COMPILE's
piecewise mode), and each piece compiled by Inductor with vLLM's pre-grad functionalization
pass and its `PostGradPassManager`; a pass added to the manager (where vLLM puts a user's
`post_grad_custom_post_pass`) records the graph it is handed. Twice: RMSNorm's IR op torch
wrapping on (vLLM's GPU default: opaque `vllm_ir` ops) and off (what `compilation_config`
sets). Each piece is written as `<wrap>_piece<i>.py`: placeholders with dtype and shape
(num_tokens as `s0`) and the graph's code.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 128, 4, 2, 32, 256
TOKENS = 7


def decoder_layer():
    import vllm.model_executor.layers.attention.attention  # noqa: F401  registers vllm::unified_attention_with_output
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    class Qwen3Layer(nn.Module):  # vllm/model_executor/models/qwen3.py, linears as F.linear
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            w = lambda *s: nn.Parameter(0.05 * torch.randn(*s, generator=g))  # noqa: E731
            q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(HIDDEN, 1e-6), RMSNorm(HIDDEN, 1e-6)
            self.q_norm, self.k_norm = RMSNorm(HEAD_DIM, 1e-6), RMSNorm(HEAD_DIM, 1e-6)
            self.qkv, self.o, self.gate_up, self.down = w(q + 2 * kv, HIDDEN), w(HIDDEN, q), w(2 * INTER, HIDDEN), w(HIDDEN, INTER)
            self.rotary_emb = get_rope(HEAD_DIM, max_position=256, is_neox_style=True,
                                       rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, dtype=torch.bfloat16)
            self.act = SiluAndMul()
            self.sizes = [q, kv, kv]

        def forward(self, positions, hidden_states, residual):
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
            q, k, v = F.linear(hidden_states, self.qkv).split(self.sizes, dim=-1)
            q = self.q_norm(q.view(*q.shape[:-1], HEADS, HEAD_DIM)).view(q.shape)
            k = self.k_norm(k.view(*k.shape[:-1], KV_HEADS, HEAD_DIM)).view(k.shape)
            q, k = self.rotary_emb(positions, q, k)
            out = torch.empty_like(q)
            torch.ops.vllm.unified_attention_with_output(q, k, v, out, "model.layers.0.self_attn.attn")
            hidden_states = F.linear(out, self.o)
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            return F.linear(self.act(F.linear(hidden_states, self.gate_up)), self.down), residual

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as vLLM builds models: buffers keep their own dtype
    try:
        return Qwen3Layer().requires_grad_(False)  # inference weights, as vLLM loads them
    finally:
        torch.set_default_dtype(default)


def capture(torch_wrap: bool, passes=()) -> list[torch.fx.GraphModule]:
    """The pieces' graphs as an added pass receives them; `passes` run after, in the manager."""
    import vllm.ir.op as ir_op
    from vllm.compilation.backends import split_graph
    from vllm.compilation.passes.inductor_pass import InductorPass, pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.utils import Range

    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["none"]))
    seen: list[torch.fx.GraphModule] = []

    class Record(InductorPass):
        def __call__(self, graph):
            seen.append(copy.deepcopy(graph.owning_module))  # a copy: later passes edit the graph

    with set_current_vllm_config(config), ir_op.enable_torch_wrap(torch_wrap), torch.no_grad():
        layer = decoder_layer()
        manager = PostGradPassManager()
        manager.configure(config)
        manager.add(Record())
        for pass_ in passes:
            manager.add(pass_)  # asserts an InductorPass, as for a user's post_grad_custom_post_pass
        dynamo_graphs = []

        def backend(gm, example_inputs):
            dynamo_graphs.append(gm)
            outputs = len(gm.graph.output_node().args[0])  # only the graph is wanted: attention needs an engine
            return lambda *args: tuple(torch.empty(0) for _ in range(outputs))

        positions = torch.arange(TOKENS)
        hidden, residual = (torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16) for _ in range(2))
        for t in (positions, hidden, residual):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.reset()
        torch.compile(layer, backend=backend, fullgraph=True)(positions, hidden, residual)
        (gm,) = dynamo_graphs
        _, items = split_graph(gm, list(CompilationConfig._attention_ops))
        patches = {"pre_grad_custom_pass": VllmIRInplaceFunctionalizationPass(config),
                   "post_grad_custom_post_pass": manager,
                   "fx_graph_cache": False}  # a cache hit would skip the passes
        from torch._inductor.compile_fx import compile_fx

        for item in items:
            if item.is_splitting_graph:
                continue
            fake = [n.meta["example_value"] for n in item.graph.graph.find_nodes(op="placeholder")]
            context = torch._guards.TracingContext(torch._guards.detect_fake_mode(fake))
            with pass_context(Range(start=1, end=8192)), torch._guards.tracing(context):
                compile_fx(item.graph, fake, config_patches=patches)
    return seen


def write(gm: torch.fx.GraphModule, path: Path, header: str) -> None:
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta["val"]
        if isinstance(val, torch.Tensor):
            inputs.append((str(val.dtype).removeprefix("torch."), tuple(d if isinstance(d, int) else str(d) for d in val.shape)))
        else:
            inputs.append(("int", str(val)))
    code = gm.code.strip()
    path.write_text(f'"""{header}"""\n\n# (dtype, shape) per argument; a symbolic size (num_tokens) is a string\n'
                    f"INPUTS = {inputs!r}\n\n\n{code}\n")


if __name__ == "__main__":
    import vllm

    from rla_compile.integrations.vllm import FP32_ROPE_ENV, keep_rope_tables_fp32

    os.environ[FP32_ROPE_ENV] = "1"  # RoPE's table as rla's compilation_config leaves it: fp32
    keep_rope_tables_fp32()
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    for wrap in (True, False):
        for i, gm in enumerate(capture(wrap)):
            name = f"wrap_{'on' if wrap else 'off'}_piece{i}"
            write(gm, out / f"{name}.py", f"{name}: piece {i} of a Qwen3 decoder layer split at attention, as a vLLM\n"
                  f"post-grad pass receives it (vLLM {vllm.__version__}, torch {torch.__version__}, IR torch wrapping\n"
                  f"{'on' if wrap else 'off'}, fp32 RoPE table). Written by capture.py; do not edit.\n")
            print(name, len(gm.graph.nodes), "nodes")
