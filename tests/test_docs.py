"""README.md and docs/ say what the program does: every relative link and anchor resolves, and
every code block runs as written (with a tiny model where it says `model`) or says on its first
line that it is a fragment and why. Output is shown in `text` blocks; a fence with no
language is an error, so a code block cannot hide as output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash", "text")
FRAGMENT = "# fragment: "  # a block's first line: not run as written, and why


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def fragment(self) -> bool:
        return self.code.startswith(FRAGMENT)


def blocks(page: Path) -> list[Block]:
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(.*)$", lines[i])
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            code = textwrap.dedent("\n".join(lines[i + 1:end]) + "\n")  # a block inside a list item is indented
            found.append(Block(page, i + 1, fence.group(2).strip(), code))
            i = end
        i += 1
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL_BLOCKS if b.language in ("python", "bash") and not b.fragment]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))
    return found


def links(page: Path) -> list[tuple[int, str]]:
    text = re.sub(r"^\s*```.*?^\s*```", lambda m: "\n" * m.group(0).count("\n"), page.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [(text[:m.start()].count("\n") + 1, m.group(1)) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for line, target in links(page):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}:{line}: {target}: {path} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}:{line}: {target}: no heading #{anchor} in {dest.name}")
            elif dest.resolve().is_relative_to(ROOT.parent) and not dest.resolve().is_relative_to(ROOT):
                broken.append(f"{page.relative_to(ROOT)}:{line}: {target}: outside the repository")
    assert not broken, "\n".join(broken)


def test_the_link_checker_finds_a_broken_anchor(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# The `rla` site: what it promises (and not)\n\nsee [x](#the-rla-site-what-it-promises-and-not)\n")
    assert anchors(page) == {"the-rla-site-what-it-promises-and-not"}
    assert links(page) == [(3, "#the-rla-site-what-it-promises-and-not")]


def test_every_fence_names_its_language_and_every_fragment_says_why():
    bad = [f"{b.id}: fence language {b.language!r}, use one of {LANGUAGES}" for b in ALL_BLOCKS
           if b.language not in LANGUAGES]
    bad += [f"{b.id}: a fragment without its reason" for b in ALL_BLOCKS
            if b.fragment and not b.code.splitlines()[0][len(FRAGMENT):].strip()]
    assert not bad, "\n".join(bad)
    assert RUNNABLE, "no block runs"


def _tiny_model():
    from rla_compile.tiny import tiny_causal_lm

    return tiny_causal_lm("llama")


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.language == "python"], ids=lambda b: b.id)
def test_python_block_runs_as_written(block, tmp_path, monkeypatch):
    """A block that says `model` gets a tiny Llama (bf16, random weights), `ids` a batch of its
    token ids; everything else it names, it imports or defines itself."""
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__doc_block__", "model": _tiny_model(),
                 "ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))}
    exec(compile(block.code, block.id, "exec"), namespace)


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.language == "bash"], ids=lambda b: b.id)
def test_bash_block_runs_as_written(block, tmp_path):
    """Run in an empty directory with this environment's commands (rla-compile) first on PATH."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, f"{block.id}:\n{block.code}\n{done.stderr[-3000:]}"
