"""Options: align some sites only, run without codegen, pin all rounding, dump debug files.

    python examples/options.py
"""

import tempfile

import torch
import torch.nn.functional as F

import rla_compile


def block(x, gate, up):
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    return normed, F.silu(gate) * up


args = [torch.randn(2, 8, 64).bfloat16() for _ in range(3)]

# 1. Through torch.compile's own options (no import needed for the backend name).
out = torch.compile(block, backend="rla", options={"sites": ["swiglu"], "inner": "aot_eager"})(*args)

# 2. Through a backend object, which keeps the reports.
with tempfile.TemporaryDirectory() as debug_dir:
    backend = rla_compile.backend(sites=["swiglu", "rmsnorm"], pin_rounding=True, debug=debug_dir)
    torch.compile(block, backend=backend)(*args)
    print(backend.reports[0])
    print(open(f"{debug_dir}/index.txt").read())

# 3. A bad option is refused with the valid ones listed.
try:
    rla_compile.backend(sites=["layernorm"])
except rla_compile.OptionError as error:
    print("refused:", error)
