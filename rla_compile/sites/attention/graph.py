"""Reading attention's pieces off a graph, for the matcher (`__init__.py`): casts and exact
upcasts looked through, scalar operands and run-time scale factors, grouped k/v undone, masks
told apart, soft-caps recognised, and the nodes a matched region owns."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Node

from ... import ops
from ...emit import Emitter

MATMUL = ("matmul", "bmm", "baddbmm", "einsum")  # a product of two tensors, as attention writes it


@dataclass(frozen=True)
class Product:
    """A product `left @ right` as a graph writes it: matmul or bmm; baddbmm (`beta · bias +
    alpha · left @ right`); a two-operand einsum over the last two dimensions ("...qd,...kd->...qk"
    is `left @ rightᵀ`: `transposed=False`, the key as stored). `transposed`: `right` is the
    key transposed (kᵀ), as matmul's second operand is."""

    left: Node
    right: Node
    transposed: bool = True
    bias: Node | None = None
    beta: float = 1.0
    alpha: float = 1.0


def einsum_form(node: Node) -> str | None:
    """'nn' (a @ b) or 'nt' (a @ bᵀ) for a two-operand einsum over the same leading (batch)
    letters whose last two are a matrix product, else None."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or len(operands) != 2 or "..." in equation or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    a, b = inputs.split(",") if inputs.count(",") == 1 else ("", "")
    if min(len(a), len(b), len(out)) < 2 or not a[:-2] == b[:-2] == out[:-2] or len(set(a)) != len(a):
        return None
    (i, contracted), (x, y) = a[-2:], b[-2:]
    if out[-2:] == i + y and x == contracted and len({i, contracted, y}) == 3:
        return "nn"
    if out[-2:] == i + x and y == contracted and len({i, contracted, x}) == 3:
        return "nt"
    return None


def product(node: Node) -> Product | None:
    """`node` as a `Product`, or None."""
    if ops.is_op(node, "matmul", "bmm") and len(node.args) == 2:
        return Product(*node.args)
    if ops.is_op(node, "baddbmm"):
        named = dict(zip(("input", "batch1", "batch2", "beta", "alpha"), node.args)) | node.kwargs
        beta, alpha = ops.constant(named.get("beta", 1)), ops.constant(named.get("alpha", 1))
        if beta is None or alpha is None:
            return None
        return Product(named["batch1"], named["batch2"], True, named["input"], float(beta), float(alpha))
    if ops.is_op(node, "einsum") and (form := einsum_form(node)) is not None:
        left, right = node.args[1]
        return Product(left, right, transposed=form == "nn")
    return None


@dataclass(frozen=True)
class Mask:
    """How the scores are masked, in fp32: `add` (a float mask added), `fill`
    (masked_fill(cond, value): True = remove), `keep` (SDPA's bool mask: True = keep, `value`
    replaces the rest), `where` (where(cond, scores, other), or `keep_first=False`
    where(cond, other, scores); other a scalar `value` or the role `mask_other`), `causal`
    (keys after the query removed)."""

    how: str
    value: float = -math.inf
    keep_first: bool = True  # where(cond, scores, other) (True) or where(cond, other, scores)

    def apply(self, e: Emitter, scores: Node, roles: dict[str, Node]) -> Node:
        if self.how == "add":
            return e.add(scores, e.fp32(roles["mask"]))
        if self.how == "fill":
            return e.masked_fill(scores, roles["mask"], self.value)
        if self.how == "keep":
            return e.masked_fill(scores, e.logical_not(roles["mask"]), self.value)
        if self.how == "where":  # where(cond, scores, other), or where(cond, other, scores)
            other = e.fp32(roles["mask_other"]) if "mask_other" in roles else self.value
            keep = roles["mask"] if self.keep_first else e.logical_not(roles["mask"])
            return e.where(keep, scores, other)
        rows, cols = scores.meta["val"].shape[-2:]
        return e.masked_fill(scores, e.above_diagonal(rows, cols, scores.meta["val"].device), -math.inf)


def through_casts(node: object, nodes: set[Node]) -> object:
    """Back through casts in either direction (a rounding inside the site is the site's)."""
    while ops.is_cast(node):
        nodes.add(node)
        node = node.args[0]
    return node


def widened(node: object, nodes: set[Node]) -> object:
    """Back through exact upcasts only: an input's rounding (RoPE's `q_embed.to(bf16)`) is the
    code before the site's, and the site reads the rounded value."""
    while ops.widens(node):
        nodes.add(node)
        node = node.args[0]
    return node


def scalar_operand(node: Node) -> tuple[Node, float] | None:
    """mul/div of a tensor by a Python scalar: (tensor, factor), division as 1/c."""
    if not ops.is_op(node, "mul", "div") or len(node.args) != 2:
        return None
    a, b = node.args
    if ops.is_op(node, "mul") and isinstance(b, Node) and ops.constant(a) is not None:
        a, b = b, a
    c = ops.constant(b)
    if not isinstance(a, Node) or c is None or c == 0:
        return None
    return a, (c if ops.is_op(node, "mul") else 1.0 / c)


def symbolic_factor(node: Node) -> tuple[Node, Node] | None:
    """mul of a tensor by a symbolic float (a scale torch.compile(dynamic=True) did not
    specialise): (tensor, the scalar's node)."""
    if not ops.is_op(node, "mul") or len(node.args) != 2:
        return None
    for a, b in (node.args, node.args[::-1]):
        if isinstance(a, Node) and isinstance(b, Node) and ops.dtype_of(a) is not None and ops.dtype_of(b) is None \
                and isinstance(b.meta.get("val"), (torch.SymFloat, torch.SymInt)):
            return a, b
    return None


def ungroup(node: object, nodes: set[Node]) -> tuple[object, int | Node]:
    """(x, groups) for HF's repeat_kv(x, groups) (unsqueeze(2), expand, reshape) or
    x.repeat_interleave(groups, dim=1); (node, 1) otherwise. `groups` is the graph's own
    argument: an int, or a node where the shapes are dynamic."""
    if ops.is_op(node, "repeat_interleave") and len(node.args) >= 2 and isinstance(node.args[1], int) and ops.shape_of(node):
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim is not None and ops.normalize_dim(dim, len(ops.shape_of(node))) == [1]:
            nodes.add(node)
            return node.args[0], node.args[1]
    if ops.is_op(node, "reshape", "view", "_unsafe_view") and ops.is_op(node.args[0], "expand"):
        expand = node.args[0]
        unsqueeze = through_slices(expand.args[0])
        if ops.is_op(unsqueeze, "unsqueeze") and unsqueeze.args[1] == 2 and len(ops.shape_of(node) or ()) == 4 \
                and ops.shape_of(unsqueeze.args[0]) is not None and ops.shape_of(expand) is not None:
            x = unsqueeze.args[0]
            same = [str(d) for d in ops.shape_of(x)]  # sizes compared as expressions: no guards
            wide = [str(d) for d in ops.shape_of(expand)]
            if len(wide) == 5 and wide[:2] == same[:2] and wide[3:] == same[2:]:
                nodes |= {node, expand, unsqueeze, *slices_between(expand.args[0], unsqueeze)}
                return x, expand.args[1][2]
    return node, 1


def through_slices(node: object) -> object:
    """Back through full slices (`x[:, :, None, :, :]` under dynamic shapes)."""
    while ops.is_op(node, "slice") and node.args[2:] in ((), (0, 9223372036854775807)):
        node = node.args[0]
    return node


def slices_between(node: object, source: object) -> set[Node]:
    found = set()
    while node is not source and ops.is_op(node, "slice"):
        found.add(node)
        node = node.args[0]
    return found


def transposed(node: object) -> object | None:
    """x for xᵀ over the last two dims (transpose, permute or `.mT`, e.g. litgpt's), else None."""
    shape = ops.shape_of(node)
    if shape is None or len(shape) < 2:
        return None
    n = len(shape)
    if ops.is_op(node, "transpose") and ops.normalize_dim(list(node.args[1:3]), n) == [n - 2, n - 1]:
        return node.args[0]
    if ops.is_op(node, "permute") and list(node.args[1]) == [*range(n - 2), n - 1, n - 2]:
        return node.args[0]
    if ops.is_op(node, "t") and n == 2:
        return node.args[0]
    if ops.is_op(node, "mT"):
        return node.args[0]
    return None


def kind_of_mask(node: Node, scores_from: Node) -> tuple[Node, Mask, dict[str, Node]] | None:
    """(the unmasked scores, the mask, its roles) when `node` masks the scores."""
    if ops.is_op(node, "add") and len(node.args) == 2 and all(isinstance(a, Node) for a in node.args):
        a, b = node.args
        scores, mask = (a, b) if leads_to(a, scores_from) else (b, a)
        return scores, Mask("add"), {"mask": mask}
    if ops.is_op(node, "masked_fill") and ops.constant(node.args[2]) is not None:
        return node.args[0], Mask("fill", ops.constant(node.args[2])), {"mask": node.args[1]}
    if ops.is_op(node, "masked_fill_") and ops.constant(node.args[2]) is not None and len(node.args[0].users) == 1:
        # in place, on scores nothing else reads: the same fill
        return node.args[0], Mask("fill", ops.constant(node.args[2])), {"mask": node.args[1]}
    if ops.is_op(node, "where") and len(node.args) == 3:
        cond, a, b = node.args
        keep_first = leads_to(a, scores_from)
        scores, other = (a, b) if keep_first else (b, a)
        if isinstance(other, Node):
            return scores, Mask("where", keep_first=keep_first), {"mask": cond, "mask_other": other}
        if ops.constant(other) is not None:
            return scores, Mask("where", ops.constant(other), keep_first), {"mask": cond}
    return None


def leads_to(node: object, target: Node, depth: int = 8) -> bool:
    """Whether `target` (the q·k matmul) is among node's floating inputs, within a few ops."""
    return first_matmul(node, depth) is target


def first_matmul(node: object, depth: int = 8) -> Node | None:
    """The nearest matmul among node's floating-point inputs (not a mask's bool chain)."""
    frontier = [node] if isinstance(node, Node) else []
    for _ in range(depth):
        found = [n for n in frontier if product(n) is not None]
        if found:
            return found[0]
        frontier = [p for n in frontier for p in n.all_input_nodes
                    if ops.dtype_of(p) is not None and ops.dtype_of(p).is_floating_point]
    return None


def softcap(node: object, nodes: set[Node]) -> tuple[Node, float] | None:
    """(x, c) for tanh(x / c) * c."""
    outer = scalar_operand(node) if isinstance(node, Node) else None
    if outer is None or not ops.is_op(outer[0], "tanh"):
        return None
    tanh, c = outer
    inner = scalar_operand(through_casts(tanh.args[0], nodes))
    if inner is None or not math.isclose(inner[1] * c, 1.0):
        return None
    nodes |= {node, tanh, through_casts(tanh.args[0], set())}
    return inner[0], c


def owned(candidates: set[Node], region: set[Node]) -> set[Node]:
    """The candidates (casts, transposes, head repeats of the inputs) that only the site reads,
    latest first: each joins when all its users are in the region."""
    owned: set[Node] = set()
    changed = True
    while changed:
        changed = False
        for node in candidates - owned:
            if all(u in region or u in owned for u in node.users):
                owned.add(node)
                changed = True
    return owned
