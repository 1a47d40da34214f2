"""Run in a fresh process by test_cache.py: compile one small aligned block, print what the
report found and what Inductor's caches did, as JSON."""

import json
import sys

import torch
from torch._dynamo.utils import counters

import rla_compile
from site_cases import glu_silu, norm_llama

options = json.loads(sys.argv[1])


def block(x, w, g, u):
    return norm_llama(x, w), glu_silu(g, u)


torch.manual_seed(0)
args = (torch.randn(2, 8, 64).bfloat16(), torch.randn(64).bfloat16(), torch.randn(2, 8, 64).bfloat16(), torch.randn(2, 8, 64).bfloat16())
backend = rla_compile.Backend(**options)
with torch.no_grad():
    out = torch.compile(block, backend=backend, fullgraph=True)(*args)
print(json.dumps({
    "report": backend.reports[0].summary(),
    "rewritten": backend.reports[0].count(status="rewritten"),
    "hit": counters["inductor"]["fxgraph_cache_hit"],
    "miss": counters["inductor"]["fxgraph_cache_miss"],
    "out": [o.float().sum().item() for o in out],
}))
