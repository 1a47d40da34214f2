"""A site of your own, tried without editing rla_compile: a matcher plus a `Site` declaration,
registered for a while with `sites.registered`. Here: a bf16 `tanh` (e.g. a soft-cap) computed in
fp32 and rounded once. docs/sites.md#adding-a-site says what each field of `Site` is for.

    python examples/custom_site.py
"""

import torch

import rla_compile
from rla_compile import sites
from rla_compile.sites import Match, Site


class TanhMatcher:
    kind = "tanh"

    def candidates(self, graph):  # cheap filter: anchors worth a look
        return [n for n in graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.tanh.default]

    def match(self, anchor):  # the region the contract computes in fp32: here the tanh alone
        return Match(self.kind, anchor, frozenset({anchor}), "tanh", {"x": anchor.args[0]})


def softcap(x):
    return torch.tanh(x / 30.0) * 30.0


site = Site(kind="tanh", matcher=TanhMatcher(), summary="tanh in fp32, rounded once", opt_in="an example")
x = torch.randn(4, 1000, dtype=torch.bfloat16) * 50
with sites.registered(site):
    backend = rla_compile.Backend(sites=[*sites.DEFAULT_SITES, "tanh"], compiler="aot_eager")
    out = torch.compile(softcap, backend=backend)(x)

print(backend.reports[0].summary())
assert [(s.kind, s.status) for s in backend.reports[0].sites] == [("tanh", "rewritten")]
want = torch.tanh((x / 30.0).float()).to(torch.bfloat16) * 30.0  # fp32 inside the site, one rounding
assert torch.equal(out, want)
print("the tanh site computed in fp32 and rounded once: equal to the eager fp32 reference")
