"""What the engine found in one graph: sites, their status and where they came from."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

from .ops import dtype_name

__all__ = ["SiteReport", "NearMiss", "GraphReport", "STATUSES", "lost_sites"]

STATUSES = ("rewritten", "already_aligned", "skipped")


@dataclass(frozen=True)
class SiteReport:
    kind: str  # one of sites.SITE_KINDS
    status: str  # one of STATUSES
    variant: str  # e.g. "llama", "gemma (1 + w)", "swiglu, fused gate_up", "neox"
    dtype: str  # the site's activation dtype: bfloat16, float16 or float32
    module: str  # module path, e.g. model.layers.0.input_layernorm ("" when the graph has none)
    source: str  # file:line in fn of the anchor op ("" when the graph has none)
    anchor: str  # the graph node the site was found from
    reason: str = ""  # why a site was skipped or is already aligned; notes on rewritten ones
    nodes: tuple[str, ...] = ()  # the region's nodes (before the rewrite)


@dataclass(frozen=True)
class NearMiss:
    """A candidate the engine looked at and did not rewrite, and the condition that failed."""

    kind: str
    anchor: str
    module: str
    reason: str


@dataclass
class GraphReport:
    graph: str  # a name for the graph: the compile id under torch.compile
    sites: list[SiteReport] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    note: str = ""  # graph-level remarks, e.g. "nothing to align: activations are float32"
    seconds: dict[str, float] = field(default_factory=dict)  # time rla spent: retrace, rewrite
    rank: int | None = None  # the process's rank under torch.distributed (tensor parallel: per rank)

    def count(self, kind: str | None = None, status: str | None = None) -> int:
        return sum(
            1
            for s in self.sites
            if (kind is None or s.kind == kind) and (status is None or s.status == status)
        )

    def counts(self, status: str | None = None) -> dict[str, int]:
        """Sites per kind, whatever their status unless `status` is given."""
        return dict(Counter(s.kind for s in self.sites if status is None or s.status == status))

    def to_dict(self) -> dict:
        return {
            "graph": self.graph,
            "note": self.note,
            "sites": [asdict(s) for s in self.sites],
            "near_misses": [asdict(m) for m in self.near_misses],
            "seconds": self.seconds,
            "rank": self.rank,
        }

    @classmethod
    def from_dict(cls, data: dict) -> GraphReport:
        """The report `to_dict` wrote (e.g. in another process)."""
        return cls(
            graph=data["graph"],
            sites=[SiteReport(**{**s, "nodes": tuple(s.get("nodes", ()))}) for s in data.get("sites", [])],
            near_misses=[NearMiss(**m) for m in data.get("near_misses", [])],
            note=data.get("note", ""),
            seconds=dict(data.get("seconds", {})),
            rank=data.get("rank"),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def _name(self) -> str:
        return self.graph if self.rank is None else f"{self.graph} (rank {self.rank})"

    def summary(self) -> str:
        """One line: counts per status and kind."""
        if not self.sites:
            return f"{self._name()}: no sites" + (f" ({self.note})" if self.note else "")
        parts = []
        for status in STATUSES:
            by_kind = Counter(s.kind for s in self.sites if s.status == status)
            if by_kind:
                parts.append(f"{status} " + ", ".join(f"{k}={n}" for k, n in sorted(by_kind.items())))
        line = f"{self._name()}: " + "; ".join(parts)
        return line + (f" ({self.note})" if self.note else "")

    def __str__(self) -> str:
        header = ("kind", "status", "variant", "dtype", "module", "source", "reason")
        rows = [
            (
                s.kind,
                s.status,
                s.variant,
                dtype_name(s.dtype, short=True),
                s.module or "-",
                s.source or s.anchor,
                s.reason,
            )
            for s in self.sites
        ]
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        lines = [f"rla report for graph {self._name()}: {len(self.sites)} site(s)"]
        if self.note:
            lines.append(f"note: {self.note}")
        if rows:
            lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
            lines.append("  ".join("-" * w for w in widths))
            lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        if self.near_misses:
            lines.append(f"near misses ({len(self.near_misses)}):")
            lines += [f"  {m.kind}: {m.reason}" for m in self.near_misses]
        return "\n".join(lines)


def lost_sites(earlier: list[GraphReport], report: GraphReport) -> list[NearMiss]:
    """The near misses of `report` at a site that an `earlier` graph rewrote: the same kind in
    the same module (a recompile, e.g. for a new sequence length, that lost a site aligned
    before). Near misses without a module are never matched: nothing says they are the same site."""
    aligned = {(s.kind, s.module) for r in earlier for s in r.sites if s.status == "rewritten" and s.module}
    return [m for m in report.near_misses if m.module and (m.kind, m.module) in aligned]
