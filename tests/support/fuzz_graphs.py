"""Random programs for the fuzzer (test_fuzz.py): site spellings and look-alikes in random
surroundings, each with its contract reference.

A program is Python source over a stream `h` of shape (d0, d1, D) in the activation dtype T:
a chain of blocks, each a surrounding op (matmul, add, mul, scale, transpose, tanh), a site
written in one of its spellings, or a look-alike that must not be rewritten. Every block
writes two texts:

- the model: the block as users write it (casts where the spelling puts them);
- the reference: the same block under the contract — for a site, its inputs upcast on entry,
  the same formula in fp32 with no rounding inside, one rounding per output (cos/sin that the
  model rounds from fp32 tables are read unrounded); for everything else, the model's text.

The reference is plain eager code and shares nothing with rla_compile. Its fp32 formula is
the one the spelling writes (`x / sqrt(...)`, `g * sigmoid(g)`), because the rewrite moves
roundings and keeps the math as written; for the canonical spelling it is
contract_reference's formula (checked in test_fuzz.py).

Choices come from a `pick(options)` callable, so the same builder serves hypothesis (which
shrinks a failure to its smallest program) and a seeded `random.Random`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import contract_reference

Pick = Callable[[Sequence], object]

DTYPE_NAMES = {torch.bfloat16: "torch.bfloat16", torch.float16: "torch.float16", torch.float32: "torch.float32"}


@dataclass
class Input:
    name: str
    kind: str  # act, matrix, norm_weight, gemma_weight, cos, sin, inv_freq, positions, freqs_cis
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Program:
    dtype: torch.dtype
    inputs: list[Input] = field(default_factory=list)
    model: list[str] = field(default_factory=list)
    reference: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    sites: list[tuple[str, str]] = field(default_factory=list)  # (kind, status) expected in the report
    misses: list[str] = field(default_factory=list)  # near-miss kinds expected in the report
    blocks: list[str] = field(default_factory=list)  # one line per block, for failure messages

    def source(self, reference: bool = False) -> str:
        args = ", ".join(i.name for i in self.inputs)
        body = self.reference if reference else self.model
        lines = [f"def {'reference' if reference else 'model'}({args}):", *("    " + line for line in body)]
        lines.append(f"    return ({', '.join(self.outputs)},)")
        return "\n".join(lines)

    def functions(self) -> tuple[Callable, Callable]:
        namespace: dict = {"torch": torch, "F": F, "_silu": torch.nn.SiLU(), "ref": contract_reference}
        exec(compile(self.source(), "<fuzz model>", "exec"), namespace)
        exec(compile(self.source(reference=True), "<fuzz reference>", "exec"), namespace)
        return namespace["model"], namespace["reference"]

    def make_inputs(self, seed: int = 0) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        return tuple(_make(spec, gen) for spec in self.inputs)

    def __str__(self) -> str:
        return "\n".join(
            [f"dtype {self.dtype}; blocks: " + " | ".join(self.blocks), self.source(), self.source(reference=True)]
        )


def _make(spec: Input, gen: torch.Generator) -> torch.Tensor:
    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    if spec.kind == "positions":
        return torch.arange(spec.shape[0])
    if spec.kind == "inv_freq":
        (n,) = spec.shape
        return 1.0 / (10000 ** (torch.arange(n, dtype=torch.float32) / n))
    if spec.kind in ("cos", "sin"):
        rows, n = spec.shape
        angles = torch.arange(rows, dtype=torch.float32)[:, None] * (1.0 / (10000 ** (torch.arange(n) / n)))[None, :]
        return (angles.cos() if spec.kind == "cos" else angles.sin()).to(spec.dtype)
    if spec.kind == "freqs_cis":
        rows, n = spec.shape
        angles = torch.arange(rows, dtype=torch.float32)[:, None] * (1.0 / (10000 ** (torch.arange(n) / n)))[None, :]
        return torch.polar(torch.ones_like(angles), angles)
    if spec.kind == "matrix":
        return (randn(*spec.shape) / math.sqrt(spec.shape[0])).to(spec.dtype)
    if spec.kind == "norm_weight":
        return (1 + 0.2 * randn(*spec.shape)).to(spec.dtype)
    if spec.kind == "gemma_weight":
        return (0.2 * randn(*spec.shape)).to(spec.dtype)
    return (randn(*spec.shape) * 2).to(spec.dtype)


class _Builder:
    """Writes one program block by block; `shape` and `last_add` track the stream."""

    def __init__(self, pick: Pick, dtype: torch.dtype, d0: int, d1: int, heads: int, head_dim: int):
        self.pick, self.T = pick, DTYPE_NAMES[dtype]
        self.p = Program(dtype)
        self.shape = [d0, d1, heads * head_dim]
        self.heads, self.head_dim = heads, head_dim
        self.counter = 0
        self.last_add = False  # the stream is an add of two same-shape tensors (a norm would read a residual)
        self.input("act", tuple(self.shape), dtype, "x")
        self.both("h = x")

    # -- text ---------------------------------------------------------------------------
    def name(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def input(self, kind: str, shape: tuple, dtype: torch.dtype, prefix: str = "a") -> str:
        name = self.name(prefix) if prefix != "x" else "x"
        self.p.inputs.append(Input(name, kind, tuple(shape), dtype))
        return name

    def both(self, *lines: str) -> None:
        self.p.model += lines
        self.p.reference += lines

    def fork(self, model: list[str], reference: list[str]) -> None:
        self.p.model += model
        self.p.reference += reference

    @property
    def dtype(self) -> torch.dtype:
        return self.p.dtype

    @property
    def low(self) -> bool:
        return self.p.dtype != torch.float32

    def site(self, kind: str, aligned: bool, note: str) -> None:
        self.p.sites.append((kind, "already_aligned" if aligned or not self.low else "rewritten"))
        self.p.blocks.append(f"{kind}: {note}")

    def round_spelling(self, value: str, like: str) -> str:
        """How the model rounds `value` back to the activation dtype of `like`."""
        return self.pick([f"{value}.to({like}.dtype)", f"{value}.type_as({like})", f"{value}.to({self.T})"])

    # -- surrounding ops ----------------------------------------------------------------
    def op(self) -> None:
        kind = self.pick(["matmul", "linear", "add", "mul", "scale", "transpose", "tanh", "fanout", "tap"])
        D = self.shape[2]
        if kind in ("matmul", "linear"):
            w = self.input("matrix", (D, D), self.dtype, "w")
            self.both("h = h @ " + w if kind == "matmul" else f"h = F.linear(h, {w})")
        elif kind in ("add", "mul"):
            other = self.input("act", tuple(self.shape), self.dtype)
            self.both(f"h = h {'+' if kind == 'add' else '*'} {other}")
        elif kind == "scale":
            self.both(self.pick(["h = h * 0.5", "h = 2.0 * h"]))
        elif kind == "fanout":  # the value before has two readers
            wa, wb = self.input("matrix", (D, D), self.dtype, "w"), self.input("matrix", (D, D), self.dtype, "w")
            self.both(f"h = torch.tanh(h @ {wa}) * (h @ {wb})")
        elif kind == "tap":  # the value before also leaves the graph
            tap = self.name("tap")
            self.both(f"{tap} = h", "h = h * 0.5")
            self.p.outputs.append(tap)
        elif kind == "transpose":
            self.both("h = h.transpose(0, 1)")
            self.shape[0], self.shape[1] = self.shape[1], self.shape[0]
        else:
            self.both("h = torch.tanh(h) * 3")
        self.last_add = kind == "add"
        self.p.blocks.append(kind)

    def not_a_residual(self) -> None:
        if self.last_add:  # a norm of an add is a residual norm: keep this one plain
            self.both("h = h * 0.5")
            self.last_add = False

    # -- RMSNorm ------------------------------------------------------------------------
    def norm_body(self, xf: str) -> tuple[list[str], str, str, float | None]:
        """Lines computing y = xf * inv_rms(xf) in one spelling (fp32 or not, as xf is), and
        the eps when the fp32 formula is contract_reference's (mean, rsqrt), else None."""
        D = self.shape[2]
        square = self.pick([f"{xf}.pow(2)", f"{xf} * {xf}", f"{xf}.square()"])
        reduce = self.pick([
            "sq.mean(-1, keepdim=True)", "sq.mean(dim=2, keepdim=True)", "torch.mean(sq, -1, True)",
            f"sq.sum(-1, keepdim=True) / {D}", f"sq.sum(dim=-1, keepdim=True) * (1.0 / {D})",
        ])
        eps = self.pick(["1e-06", "1e-05"])
        with_eps = self.pick([f"ms + {eps}", f"{eps} + ms", f"ms.add({eps})", "ms"])
        inverse = self.pick(["rsqrt", "1/sqrt", "pow", "div", "reciprocal"])
        y = {
            "rsqrt": self.pick([f"{xf} * torch.rsqrt(v)", f"torch.rsqrt(v) * {xf}"]),
            "1/sqrt": f"{xf} * (1 / torch.sqrt(v))",
            "pow": f"{xf} * v.pow(-0.5)",
            "div": f"{xf} / torch.sqrt(v)",
            "reciprocal": f"torch.sqrt(v).reciprocal() * {xf}",
        }[inverse]
        lines = [f"sq = {square}", f"ms = {reduce}", f"v = {with_eps}", f"y = {y}"]
        canonical = inverse == "rsqrt" and "mean" in reduce
        eps_value = (0.0 if with_eps == "ms" else float(eps)) if canonical else None
        return lines, "y", f"{square}, {reduce}, {with_eps}, {inverse}", eps_value

    def rmsnorm(self, residual: bool = False) -> None:
        D = self.shape[2]
        upcast = self.pick(["float", "to", "none"])
        weight = self.pick(["llama", "gemma", None])
        w32 = weight is not None and self.pick([False, True])  # _keep_in_fp32_modules
        round_after = upcast != "none" and weight is not None and self.pick([False, True])
        w = None
        if weight is not None:
            kind = "gemma_weight" if weight == "gemma" else "norm_weight"
            w = self.input(kind, (D,), torch.float32 if w32 else self.dtype, "w")

        model, reference = [], []
        x, fp32_sum = "h", False
        if residual:
            r = self.input("act", tuple(self.shape), self.dtype, "r")
            fp32_sum = upcast != "none" and self.pick([False, True])  # vLLM native: the fp32 sum feeds the norm
            if fp32_sum:
                model += [f"s = h.float() + {r}.float()", f"s_out = {self.round_spelling('s', 'h')}"]
            else:
                model += [self.pick([f"s = h + {r}", f"s = {r} + h"]), "s_out = s"]
            reference += [f"s = h.float() + {r}.float()", f"s_out = s.to({self.T})"]
            x = "s"
        else:
            self.not_a_residual()
        if weight != "gemma" and not w32 and not (residual and fp32_sum) and self.pick([False, False, True]):
            # F.rms_norm / nn.RMSNorm: fp32 inside, one rounding (the backend decomposes it)
            eps = self.pick([1e-06, 1e-05])
            upcast_first = self.low and self.pick([False, True])  # torchtune: fp32 input, bf16 weight (eps added in place)
            if upcast_first:
                model.append(f"out = F.rms_norm({x}.float(), ({D},), {w}, {eps}).to({self.T})")
            else:
                model.append(f"out = F.rms_norm({x}, ({D},), {w}, {eps})")
            reference.append(f"out = ref.rmsnorm({x}, {w}, eps={eps}, out_dtype={self.T})")
            self.fork([*model, "h = out"], [*reference, "h = out"])
            self._norm_done(residual, not residual, f"F.rms_norm weight={weight} upcast_first={upcast_first}")
            return
        xf = {"float": f"{x}.float()", "to": f"{x}.to(torch.float32)", "none": x}[upcast]
        model.append(f"xf = {xf}")
        body, y, note, eps = self.norm_body("xf")
        model += body

        out_fp32 = w32 and not round_after  # bf16 activations times an fp32 weight promote
        if weight is None:
            model.append("out = " + (self.round_spelling(y, "h") if upcast != "none" else y))
        else:
            w_as = self.pick([w, f"{w}.type_as(xl)"]) if weight == "llama" else w  # OLMo-core: w.type_as(x)
            scale = w_as if weight == "llama" else self.pick([f"(1 + {w})", f"({w} + 1)"])
            if round_after:
                scale32 = f"{w}.float()" if weight == "llama" else f"(1.0 + {w}.float())"
                model.append("out = " + self.round_spelling(f"({y} * {scale32})", "h"))
            else:
                yl = self.round_spelling(y, "h") if upcast != "none" else y
                model.append(f"xl = {yl}")
                model.append(self.pick(["out = {scale} * xl", "out = xl * {scale}"]).format(scale=scale))
        out_dtype = "torch.float32" if out_fp32 else self.T
        if eps is not None:
            reference.append(f"out = ref.rmsnorm({x}, {w}, eps={eps}, gemma={weight == 'gemma'}, out_dtype={out_dtype})")
        else:  # the spelling's own fp32 formula (1/sqrt, x / sqrt, sum / D ...), rounded once
            reference += [f"xf = {x}.float()", *body]
            if weight is None:
                result = y
            else:
                result = f"{y} * {w}.float()" if weight == "llama" else f"{y} * (1.0 + {w}.float())"
            reference.append(f"out = ({result}).to({out_dtype})")
        if out_fp32:  # the next matmul needs the activation dtype again, as in HF with fp32 norms
            model.append(f"out = out.to({self.T})")
            reference.append(f"out = out.to({self.T})")
        self.fork([*model, "h = out"], [*reference, "h = out"])
        aligned = upcast != "none" and (round_after or weight is None) and not (residual and not fp32_sum)
        self._norm_done(residual, aligned, f"upcast={upcast} weight={weight} w32={w32} round_after={round_after} {note}")

    def _norm_done(self, residual: bool, aligned: bool, note: str) -> None:
        if residual:  # the residual stream leaves the site too, rounded once
            stream = self.name("s_out")
            self.both(f"{stream} = s_out")
            self.p.outputs.append(stream)
        self.site("residual_rmsnorm" if residual else "rmsnorm", aligned, note)
        self.last_add = False

    # -- SwiGLU / GeGLU -----------------------------------------------------------------
    def swiglu(self) -> None:
        D = self.shape[2]
        Fd = self.pick([D, 2 * D, 24])
        fused = self.pick([None, "chunk", "split", "slices"])
        lines = []
        if fused is None:
            wg, wu = self.input("matrix", (D, Fd), self.dtype, "wg"), self.input("matrix", (D, Fd), self.dtype, "wu")
            lines += [f"g = h @ {wg}", f"u = h @ {wu}"]
        else:
            wgu = self.input("matrix", (D, 2 * Fd), self.dtype, "wgu")
            first, second = self.pick([("g", "u"), ("u", "g")])
            split = {
                "chunk": "gu.chunk(2, dim=-1)",
                "split": f"gu.split({Fd}, dim=-1)",
                "slices": f"gu[..., :{Fd}], gu[..., {Fd}:]",
            }[fused]
            lines += [f"gu = h @ {wgu}", f"{first}, {second} = {split}"]
        act = self.pick(["silu", "module", "x_sigmoid", "sigmoid_x", "gelu_tanh", "gelu"])

        def activation(g):
            return {
                "silu": f"F.silu({g})", "module": f"_silu({g})", "x_sigmoid": f"{g} * torch.sigmoid({g})",
                "sigmoid_x": f"torch.sigmoid({g}) * {g}", "gelu_tanh": f"F.gelu({g}, approximate='tanh')",
                "gelu": f"F.gelu({g})",
            }[act]

        upcast = self.pick(["none", "gate", "both"])
        product = self.pick(["a * {u}", "{u} * a"])
        if upcast == "none":
            model = ["gf = g", f"a = {activation('gf')}", "y = " + product.format(u="u")]
        elif upcast == "gate":
            rounded = self.round_spelling(f"({activation('gf')})", "g")
            model = ["gf = g.float()", f"a = {rounded}", "y = " + product.format(u="u")]
        else:
            model = ["gf = g.float()", f"a = {activation('gf')}", "y = " + self.round_spelling(f"({product.format(u='u.float()')})", "g")]
        formula = {"silu": "silu", "module": "silu", "x_sigmoid": "x_sigmoid", "sigmoid_x": "x_sigmoid"}.get(act, act)
        reference = [f"y = ref.gated(g, u, {formula!r})"]
        wd = self.input("matrix", (Fd, D), self.dtype, "wd")
        self.both(*lines)
        self.fork(model, reference)
        self.both(f"h = y @ {wd}")
        self.site("swiglu", upcast == "both", f"act={act} fused={fused} upcast={upcast} {product}")
        self.last_add = False

    # -- RoPE ---------------------------------------------------------------------------
    def _tables(self, rows: int, n: int, layout: str, upcast: bool) -> tuple[list[str], list[str], str]:
        """cos/sin of shape (rows, n) from one source -> (model lines, reference lines, note)."""
        source = self.pick(["table", "fp32_table", "fp32_table_rounded", "computed"])
        if not self.low:
            source = "fp32_table"
        if source == "fp32_table_rounded" and self.pick([False, True]):  # a cache gathered by position
            c = self.input("cos", (rows + 4, n), torch.float32, "cos_cache")
            s = self.input("sin", (rows + 4, n), torch.float32, "sin_cache")
            pos = self.input("positions", (rows,), torch.int64, "pos")
            model = self.pick([f"cos, sin = {c}[{pos}].to({self.T}), {s}[{pos}].to({self.T})",
                               f"cos, sin = {c}.to({self.T})[{pos}], {s}.to({self.T})[{pos}]"])
            return [model], [f"cos, sin = {c}[{pos}], {s}[{pos}]"], "fp32_cache_gathered"
        if source in ("table", "fp32_table"):
            dtype = self.dtype if source == "table" else torch.float32
            c, s = self.input("cos", (rows, n), dtype, "cos"), self.input("sin", (rows, n), dtype, "sin")
            lines = [f"cos, sin = {c}, {s}"]
            return lines, lines, source
        if source == "fp32_table_rounded":
            c, s = self.input("cos", (rows, n), torch.float32, "cos"), self.input("sin", (rows, n), torch.float32, "sin")
            model = [f"cos, sin = {c}.to({self.T}), {s}.to({self.T})"]
            return model, [f"cos, sin = {c}, {s}"], source
        # computed in the graph from positions, HF style, then rounded for the sites
        half = n // 2 if layout != "pairs" else n
        inv = self.input("inv_freq", (half,), torch.float32, "inv_freq")
        pos = self.input("positions", (rows,), torch.int64, "pos")
        emb = {"neox": "torch.cat((freqs, freqs), dim=-1)", "gptj": "freqs.repeat_interleave(2, dim=-1)", "pairs": "freqs"}[layout]
        common = [f"freqs = {pos}[:, None].float() * {inv}[None, :]", f"emb = {emb}"]
        return ([*common, f"cos, sin = emb.cos().to({self.T}), emb.sin().to({self.T})"],
                [*common, "cos, sin = emb.cos(), emb.sin()"], source)

    def rope(self) -> None:
        d0, d1, D = self.shape
        H, hd = self.heads, self.head_dim
        style = self.pick(["neox", "neox_chunk", "neox_unbind", "gptj", "pairs_interleaved", "pairs_halves",
                           "pairs_gptfast", "complex"])
        two = self.pick([False, True])  # q and k: two sites sharing the tables
        partial = style in ("neox", "gptj") and self.pick([False, True])
        n = hd // 2 if partial or style.startswith("pairs") or style == "complex" else hd
        upcast = style == "complex" or (self.low and self.pick([False, True]))
        heads = ["q"] + (["k"] if two else [])
        self.both(f"q = h.reshape({d0}, {d1}, {H}, {hd}).transpose(1, 2)")
        if two:
            wk = self.input("matrix", (D, D), self.dtype, "wk")
            self.both(f"k = (h @ {wk}).reshape({d0}, {d1}, {H}, {hd}).transpose(1, 2)")

        if style == "complex":
            freqs = self.input("freqs_cis", (d1, n), torch.complex64, "freqs")
            for t in heads:
                body = (f"torch.view_as_real(torch.view_as_complex({t}.float().reshape({d0}, {H}, {d1}, -1, 2)) * {freqs})"
                        ".flatten(-2)")
                self.fork([f"{t}_out = {body}.type_as({t})"], [f"{t}_out = {body}.to({self.T})"])
            self._rope_done(heads, True, f"complex two={two}")
            return

        layout = "neox" if style.startswith("neox") else "gptj" if style == "gptj" else "pairs"
        table_model, table_ref, source = self._tables(d1, n, layout, upcast)
        self.fork(table_model, table_ref)
        if self.pick([False, True]):  # HF's cos.unsqueeze(unsqueeze_dim) before the sites
            self.both("cos, sin = cos.unsqueeze(0).unsqueeze(0), sin[None, None]")
        order = self.pick(["x * cos + r * sin", "r * sin + x * cos", "cos * x + sin * r"])
        split = self.pick(["chunk", "slices"])

        def rotation(x: str, cos: str, sin: str) -> list[str]:
            """Lines computing `out` from x (shape ..., m) in this style."""
            m = n if partial or not style.startswith("pairs") else hd
            if style == "neox":
                rot = self.pick([f"torch.cat((-{x}[..., {m // 2}:], {x}[..., :{m // 2}]), dim=-1)",
                                 f"torch.cat((-{x}[..., {x}.shape[-1] // 2:], {x}[..., : {x}.shape[-1] // 2]), dim=-1)"])
                return [f"r = {rot}", "out = " + order.replace("x", x).replace("cos", cos).replace("sin", sin)]
            if style in ("neox_chunk", "neox_unbind"):  # ESM's rotate_half; OLMo-core's view(..., 2, h/2).unbind(-2)
                halves = (f"{x}.chunk(2, dim=-1)" if style == "neox_chunk"
                          else f"{x}.reshape(*{x}.shape[:-1], 2, {x}.shape[-1] // 2).unbind(-2)")
                return [f"x1, x2 = {halves}", "r = torch.cat((-x2, x1), dim=-1)",
                        "out = " + order.replace("x", x).replace("cos", cos).replace("sin", sin)]
            if style == "gptj":
                return [f"r = torch.stack((-{x}[..., 1::2], {x}[..., ::2]), dim=-1).flatten(-2)",
                        "out = " + order.replace("x", x).replace("cos", cos).replace("sin", sin)]
            if style == "pairs_gptfast":
                return [f"xs = {x}.reshape(*{x}.shape[:-1], -1, 2)", "x1, x2 = xs[..., 0], xs[..., 1]",
                        f"out = torch.stack([x1 * {cos} - x2 * {sin}, x2 * {cos} + x1 * {sin}], -1).flatten(-2)"]
            if style == "pairs_interleaved":
                parts = f"x1, x2 = {x}[..., 0::2], {x}[..., 1::2]"
            else:
                parts = f"x1, x2 = {x}.chunk(2, dim=-1)" if split == "chunk" else f"x1, x2 = {x}[..., :{hd // 2}], {x}[..., {hd // 2}:]"
            return [parts, f"out = torch.cat([x1 * {cos} - x2 * {sin}, x2 * {cos} + x1 * {sin}], dim=-1)"]

        for t in heads:
            xr = f"{t}[..., :{n}]" if partial else t
            model, reference = [], []
            if upcast:
                model += [f"xq = {xr}.float()"] + rotation("xq", "cos.float()", "sin.float()")
                model.append(f"out = {self.round_spelling('out', t)}")
            else:
                model += [f"xq = {xr}"] + rotation("xq", "cos", "sin")
                if self.low and source == "fp32_table":  # fp32 tables promote: round back at the end
                    model.append(f"out = {self.round_spelling('out', t)}")
            tail = [f"{t}_out = torch.cat((out, {t}[..., {n}:]), dim=-1)" if partial else f"{t}_out = out"]
            if style in ("neox", "neox_chunk", "neox_unbind", "gptj"):
                reference = [f"{t}_out = ref.rope({t}, cos, sin, style={layout!r}, rotary_dim={n})"]
            elif style in ("pairs_interleaved", "pairs_halves"):
                reference = [f"{t}_out = ref.rope_pairs({t}, cos, sin, layout={style.removeprefix('pairs_')!r})"]
            else:  # gpt-fast's pairs, interleaved back on output: its own fp32 formula
                reference = [f"xq = {xr}.float()", *rotation("xq", "cos.float()", "sin.float()"), f"out = out.to({self.T})", *tail]
            self.fork(model + tail, reference)
        aligned = upcast and source in ("table", "fp32_table")
        self._rope_done(heads, aligned, f"style={style} partial={partial} upcast={upcast} tables={source} {order} two={two}")

    def _rope_done(self, heads: list[str], aligned: bool, note: str) -> None:
        d0, d1, D = self.shape
        self.both(f"h = q_out.transpose(1, 2).reshape({d0}, {d1}, {D})")
        if "k" in heads:
            k = self.name("k_out")
            self.both(f"{k} = k_out")
            self.p.outputs.append(k)
        for _ in heads:
            self.site("rope", aligned, note)
        self.last_add = False

    def attention(self) -> None:
        """Self-attention over the stream: q from h, k and v projected (one shared k/v head
        for two query heads: grouped), spelled as HF's eager chain or SDPA."""
        d0, d1, D = self.shape
        H, hd = self.heads, self.head_dim
        kv = self.pick([H, 1]) if H > 1 else 1
        style = self.pick(["eager", "eager_bf16_softmax", "q_scaled", "div", "sdpa", "einsum", "bmm", "baddbmm",
                           "inplace_fill"])
        causal = self.pick([False, True])
        softcap = self.pick([None, 30.0]) if style.startswith("eager") else None
        wk, wv = (self.input("matrix", (D, kv * hd), self.dtype, w) for w in ("wk", "wv"))
        self.both(f"q = h.reshape({d0}, {d1}, {H}, {hd}).transpose(1, 2)",
                  f"k = (h @ {wk}).reshape({d0}, {d1}, {kv}, {hd}).transpose(1, 2)",
                  f"v = (h @ {wv}).reshape({d0}, {d1}, {kv}, {hd}).transpose(1, 2)")
        root = math.sqrt(hd)
        scale = 1.0 / root if style == "div" else hd**-0.5
        mask = None  # an additive mask the reference adds (baddbmm's bias)
        tril = f"torch.ones({d1}, {d1}, dtype=torch.bool).tril()"
        if style == "sdpa":
            model = [f"o = F.scaled_dot_product_attention(q, k, v, is_causal={causal}, enable_gqa={kv != H})"]
        elif style in ("einsum", "bmm", "baddbmm", "inplace_fill"):  # the other spellings people write
            model = [f"k = k[:, :, None].expand({d0}, {kv}, {H // kv}, {d1}, {hd}).reshape({d0}, {H}, {d1}, {hd})",
                     f"v = v[:, :, None].expand({d0}, {kv}, {H // kv}, {d1}, {hd}).reshape({d0}, {H}, {d1}, {hd})"]
            fill = "float('-inf')" if style == "einsum" else f"torch.finfo({self.T}).min"
            flat = f"{d0 * H}, {d1}"
            if style == "einsum":
                model.append(f"s = torch.einsum('bhqd,bhkd->bhqk', q, k) * {scale!r}")
            elif style == "inplace_fill":
                model.append(f"s = torch.matmul(q, k.transpose(-1, -2)) * {scale!r}")
            else:  # heads flattened into the batch
                model.append(f"q3, k3, v3 = (t.reshape({flat}, {hd}) for t in (q, k, v))")
                if style == "bmm":
                    model.append(f"s = torch.bmm(q3, k3.transpose(1, 2)) * {scale!r}")
                else:  # ALiBi's spelling: the bias added by baddbmm, the scale as its alpha
                    mask = self.input("act", (d0, H, d1, d1), self.dtype, "bias")
                    self.both(f"bias = {mask}" + (f".masked_fill(~{tril}, torch.finfo({self.T}).min)" if causal else ""))
                    model.append(f"s = torch.baddbmm(bias.reshape({flat}, {d1}), q3, k3.transpose(1, 2), beta=1, "
                                 f"alpha={scale!r})")
            if causal and style == "inplace_fill":
                model.append(f"s.masked_fill_(~{tril}, {fill})")
            elif causal and style == "baddbmm":
                causal = False  # folded into the bias
            elif causal:
                model.append(f"s = s.masked_fill(~{tril}, {fill})")
            if style == "einsum":
                model += ["p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)",
                          "o = torch.einsum('bhqk,bhkd->bhqd', p, v)"]
            elif style == "inplace_fill":
                model += ["p = torch.softmax(s.float(), dim=-1).to(q.dtype)", "o = p @ v"]
            else:
                model += ["p = torch.softmax(s.float(), dim=-1).to(q.dtype)",
                          f"o = torch.bmm(p, v3).reshape({d0}, {H}, {d1}, {hd})"]
            if style != "einsum" and causal:  # the dtype's minimum, as the model fills: the reference too
                causal = None
        else:
            model = [f"k = k[:, :, None].expand({d0}, {kv}, {H // kv}, {d1}, {hd}).reshape({d0}, {H}, {d1}, {hd})",
                     f"v = v[:, :, None].expand({d0}, {kv}, {H // kv}, {d1}, {hd}).reshape({d0}, {H}, {d1}, {hd})"]
            if style == "q_scaled":
                model.append(f"s = (q * {scale!r}) @ k.transpose(-2, -1)")
            elif style == "div":
                model.append(f"s = q @ k.transpose(-2, -1) / {root!r}")
            else:
                model.append(f"s = torch.matmul(q, k.transpose(2, 3)) * {scale!r}")
            if softcap is not None:
                model.append(f"s = torch.tanh(s / {softcap}) * {softcap}")
            if causal:
                model.append(f"s = s.masked_fill(~torch.ones({d1}, {d1}, dtype=torch.bool).tril(), float('-inf'))")
            model.append("p = torch.softmax(s, dim=-1)" if style == "eager_bf16_softmax"
                         else "p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)")
            model.append("o = p @ v")
        scale = None if style == "sdpa" else scale  # SDPA's default: 1 / math.sqrt(E), as the reference's
        if causal is None:  # filled with the dtype's minimum: a bool mask and that fill, in the reference
            reference = [f"o = ref.attention(q, k, v, mask={tril}, fill=torch.finfo({self.T}).min, scale={scale!r}, "
                         f"softcap={softcap}, groups={H // kv})"]
        else:
            reference = [f"o = ref.attention(q, k, v, scale={scale!r}, causal={causal}, softcap={softcap}, "
                         f"groups={H // kv})"]
        if mask is not None:  # the bias (an ALiBi-like additive mask, the causal one folded in): an input of both
            reference = [reference[0].replace("ref.attention(q, k, v, ", "ref.attention(q, k, v, mask=bias, ")]
        self.fork(model, reference if self.low else model)
        self.both(f"h = o.transpose(1, 2).reshape({d0}, {d1}, {D})")
        self.site("attention", False, f"style={style} causal={causal} softcap={softcap} kv_heads={kv}/{H}")
        self.last_add = False

    # -- look-alikes: rewritten by nothing, reported (kind) or ignored (None) ------------
    def lookalike(self) -> None:
        d0, d1, D = self.shape
        other = self.input("act", tuple(self.shape), self.dtype)
        T = self.T
        cases = {
            "norm_wrong_dim": (["hf = h.float()", f"h = (hf * torch.rsqrt(hf.pow(2).mean({self.pick([0, 1])}, keepdim=True) + 1e-6)).to({T})"], "rmsnorm"),
            "norm_not_square": (["hf = h.float()", f"h = (hf * torch.rsqrt(hf.abs().mean(-1, keepdim=True) + 1e-6)).to({T})"], "rmsnorm"),
            "norm_cube": (["hf = h.float()", f"h = (hf * torch.rsqrt(hf.pow(3).abs().mean(-1, keepdim=True) + 1e-6)).to({T})"], "rmsnorm"),
            "norm_layernorm": (["hf = h.float()", "c = hf - hf.mean(-1, keepdim=True)",
                                f"h = (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)).to({T})"], "rmsnorm"),
            "norm_other_input": ([f"h = {other} * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)"], "rmsnorm"),
            "norm_times_sqrt": (["h = h * torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)"], "rmsnorm"),
            "norm_no_root": ([f"h = h / (h.pow(2).mean(-1, keepdim=True) + 1e-6)"], None),
            "glu_not_gated": (["h = F.silu(h) * h"], "swiglu"),
            "glu_gate": ([f"h = {other} * torch.sigmoid(h)"], "swiglu"),
            "glu_quick_gelu": ([f"h = h * torch.sigmoid(1.702 * h) * {other}"], "swiglu"),
            "glu_added": ([f"h = F.silu(h) + {other}"], "swiglu"),
            "glu_ungated": ([f"h = F.gelu(h) @ {self.input('matrix', (D, D), self.dtype, 'w')}"], "swiglu"),
            "glu_broadcast": ([f"h = F.silu(h) * {other}[..., :1]"], "swiglu"),
            "rope_wrong_half": ([f"h = h * {other} + torch.cat((-h[..., :{D // 2}], h[..., {D // 2}:]), dim=-1) * {other}"], "rope"),
            "rope_neg_second": ([f"h = h * {other} + torch.cat((h[..., {D // 2}:], -h[..., :{D // 2}]), dim=-1) * {other}"], "rope"),
            "rope_not_swapped": ([f"h = h * {other} + torch.cat((h[..., {D // 2}:], h[..., :{D // 2}]), dim=-1) * {other}"], None),
            "rope_half_scaled": ([f"h = h * {other} + torch.cat((h[..., {D // 2}:] * 0.5, h[..., :{D // 2}]), dim=-1) * {other}"], None),
            "rope_not_added": ([f"h = torch.cat((-h[..., {D // 2}:], h[..., :{D // 2}]), dim=-1) * {other} - h * 0.5"], "rope"),
            "rope_other_x": ([f"h = h * h.tanh() + torch.cat((-{other}[..., {D // 2}:], {other}[..., :{D // 2}]), dim=-1) * h"], "rope"),
            "rope_pairs_wrong_sign": (["x1, x2 = h[..., 0::2], h[..., 1::2]",
                                       f"h = torch.cat([x1 * {other}[..., ::2] + x2 * 0.5, x2 * {other}[..., ::2] - x1 * 0.5], dim=-1)"], None),
            "rope_rot_times_x": ([f"h = h * {other} + torch.cat((-h[..., {D // 2}:], h[..., :{D // 2}]), dim=-1) * h"], "rope"),
            # a weightless norm, rounded once, then a multiplier that is not a per-channel weight:
            # the site must not take it in (that would drop the rounding between them)
            "norm_full_multiplier": (["hf = h.float()", "y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)",
                                      f"h = y.to({T}) * {other}"], None),
            "norm_scalar_multiplier": (["hf = h.float()", "y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)",
                                        f"h = y.to({T}) * {other}[0, 0, :1]"], None),
        }
        name = self.pick(sorted(cases))
        lines, miss = cases[name]
        if name.startswith("norm_") and name.endswith("_multiplier"):
            self.not_a_residual()
            self.site("rmsnorm", True, "weightless, then a multiplier that is not a weight")
        self.both(*lines)
        if miss is not None:
            self.p.misses.append(miss)
        self.p.blocks.append(f"look-alike {name}")
        self.last_add = name in ("glu_added", "rope_wrong_half", "rope_neg_second", "rope_not_swapped", "rope_other_x",
                                 "rope_rot_times_x", "rope_half_scaled")


def build(pick: Pick, blocks: int | None = None, lookalikes: bool = True) -> Program:
    """One random program: 1-4 blocks in random surroundings, bf16 or fp16 (fp32 rarely)."""
    dtype = pick([torch.bfloat16, torch.bfloat16, torch.float16, torch.float16, torch.float32])
    heads, head_dim = pick([1, 2]), pick([4, 8, 12, 16])
    b = _Builder(pick, dtype, pick([1, 2, 3]), pick([3, 5, 8]), heads, head_dim)
    kinds = ["op", "rmsnorm", "residual_rmsnorm", "swiglu", "rope", "attention"] + (["lookalike"] * 2 if lookalikes else [])
    for _ in range(blocks if blocks is not None else pick([1, 2, 3, 4])):
        kind = pick(kinds)
        if kind == "op":
            b.op()
        elif kind == "rmsnorm":
            b.rmsnorm()
        elif kind == "residual_rmsnorm":
            b.rmsnorm(residual=True)
        else:
            getattr(b, kind)()
    if pick([False, True]):
        b.op()
    b.p.outputs.insert(0, "h")
    return b.p
