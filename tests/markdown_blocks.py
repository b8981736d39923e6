"""The ```python blocks of a Markdown page (README.md or a page under docs/), read and run as a reader would.

The blocks of one ``## `` section run in order in one namespace (a later block continues an earlier one), which
starts as :func:`diffusers_causal_kv.testing.doc_namespace`: the names the pages leave to the reader (``pipe``,
``transformer``, ``noise``, ``prompt_embeds``, ...) bound to tiny random objects built in code. Each section starts
afresh. A block that cannot run here is marked on the line before its fence by an HTML comment,
``<!-- readme-test: skip: the reason -->``; a skip without a reason fails. A section whose prose says the causal
processors are already installed is named in :data:`INSTALLED` (the same title on any page).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from diffusers_causal_kv import CausalWanAttnProcessor
from diffusers_causal_kv.testing import doc_namespace

SKIP = re.compile(r"<!--\s*readme-test:\s*skip\b:?\s*(.*?)\s*-->")
FENCE = re.compile(r"^\s*```python\s*$", flags=re.MULTILINE)
# Sections whose prose says the processors are already installed on `pipe`/`transformer` when the blocks start.
INSTALLED = {"The rollout helper", "Reliability"}


@dataclass(frozen=True)
class Block:
    section: str
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the reason, when the page marks the block as not run


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks of a page (fences may be indented, e.g. inside a list item), with their section."""
    lines = text.splitlines()
    blocks, section, i = [], "(top)", 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+)\s*(\S*)", lines[i])
        if fence is None:
            if lines[i].startswith("## ") or (lines[i].startswith("# ") and section == "(top)"):
                section = lines[i].lstrip("#").strip()  # a page's title names the blocks before its first section
            i += 1
            continue
        indent, ticks, info = fence.groups()
        start, i = i, i + 1
        while i < len(lines) and not lines[i].strip().startswith(ticks):
            i += 1
        if info == "python":
            previous = next((line for line in reversed(lines[:start]) if line.strip()), "")
            marker = SKIP.search(previous)
            code = textwrap.dedent("\n".join(lines[start + 1:i]))
            blocks.append(Block(section, start + 1, code, None if marker is None else marker.group(1)))
        i += 1
    return blocks


def sections(blocks: list[Block]) -> list[str]:
    """The sections that hold blocks, in page order."""
    return list(dict.fromkeys(block.section for block in blocks))


def check_blocks(page: Path) -> list[Block]:
    """The page's blocks, after checking that every ```python fence was read and that every skip has a reason."""
    blocks = python_blocks(page.read_text())
    assert len(blocks) == len(FENCE.findall(page.read_text())), f"{page}: a ```python fence the extractor missed"
    assert [b for b in blocks if b.skip is not None and not b.skip] == [], f"{page}: a skipped block without a reason"
    return blocks


def run_section(page: Path, blocks: list[Block], section: str) -> int:
    """Run the blocks of ``section`` not marked skip in a fresh namespace; return how many ran. A traceback names the
    page and its own line numbers."""
    torch.manual_seed(0)
    namespace = doc_namespace(CausalWanAttnProcessor() if section in INSTALLED else None)
    ran = 0
    for block in blocks:
        if block.section != section or block.skip is not None:
            continue
        exec(compile("\n" * block.line + block.code, str(page), "exec"), namespace)
        ran += 1
    return ran
