"""Every ```python block of README.md runs here, so the README cannot drift from the package.

The blocks of one ``## `` section run in order in one namespace (a later block continues an earlier one, as a
reader would), which starts with the names the README leaves to the reader bound to tiny random objects built in
code (nothing is downloaded): ``transformer`` (a stock tiny ``WanTransformer3DModel``), ``pipe`` (a ``WanPipeline``
around it), latents such as ``noise``, ``clean`` and ``chunk``, and prompt embeddings such as ``prompt_embeds`` and
``text``. A block that cannot run here is marked in the README by an HTML comment on the line before its fence,
``<!-- readme-test: skip: the reason -->``; a skip without a reason fails.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from diffusers_causal_kv import CausalWanAttnProcessor
from diffusers_causal_kv.testing import tiny_conditioning, tiny_pipeline_components, tiny_wan

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\b:?\s*(.*?)\s*-->")
# Sections whose prose says the processors are already installed on `pipe`/`transformer` when the blocks start.
INSTALLED = {"The rollout helper", "Reliability"}


@dataclass(frozen=True)
class Block:
    section: str
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the reason, when the README marks the block as not run


def readme_blocks(text: str | None = None) -> list[Block]:
    """The ```python blocks of the README (fences may be indented, e.g. inside a list item), with their section."""
    lines = (README.read_text() if text is None else text).splitlines()
    blocks, section, i = [], "(top)", 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+)\s*(\S*)", lines[i])
        if fence is None:
            if lines[i].startswith("## "):
                section = lines[i][3:].strip()
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


def _latents(frames: int, seed: int) -> torch.Tensor:
    """``[1, 16, frames, 8, 8]`` latents: 16 tokens per latent frame after the 1x2x2 patch."""
    return torch.randn(1, 16, frames, 8, 8, generator=torch.Generator().manual_seed(seed))


def setup_namespace(section: str) -> dict:
    """The reader's objects the README's blocks take as given, tiny and fresh for each section."""
    transformer = tiny_wan()
    if section in INSTALLED:
        transformer.set_attn_processor(CausalWanAttnProcessor())
    text = tiny_conditioning(transformer, batch=1, seed=1)[0]
    return {
        "transformer": transformer,
        # a tiny text encoder, tokenizer and VAE built in code, so the pipeline sections run prompts to frames
        "pipe": WanPipeline(**{**tiny_pipeline_components(transformer),
                               "scheduler": FlowMatchEulerDiscreteScheduler()}),
        "batch": 1,
        "noise": _latents(6, 0),
        "clean": _latents(6, 1),
        "chunk": _latents(3, 2),
        "clean_chunk": _latents(3, 3),
        "clip_latents": _latents(2, 4),
        "first_half": [_latents(1, 10 + i) for i in range(2)],
        "second_half": [_latents(1, 20 + i) for i in range(2)],
        "prompt_embeds": text,
        "text": text,
        "negative_embeds": tiny_conditioning(transformer, batch=1, seed=2)[0],
        "new_prompt_embeds": tiny_conditioning(transformer, batch=1, seed=3)[0],
        # stands in for a distillation loss (DMD) of the reader's training code
        "dmd_loss": lambda latents, exit_steps: latents.square().mean(),
    }


BLOCKS = readme_blocks()
SECTIONS = list(dict.fromkeys(block.section for block in BLOCKS))


def test_every_python_block_is_found_and_every_skip_has_a_reason():
    text = README.read_text()
    assert len(BLOCKS) == len(re.findall(r"^\s*```python\s*$", text, flags=re.MULTILINE)) >= 8
    assert [b for b in BLOCKS if b.skip is not None and not b.skip] == [], "a skipped block without a reason"


def test_the_extractor_reads_indented_fences_and_skip_markers():
    blocks = readme_blocks("## A\n\n* item:\n\n  ```python\n  x = 1\n  ```\n\n"
                           "<!-- readme-test: skip: needs weights -->\n```python\nload()\n```\n"
                           "## B\n```bash\nls\n```\n")
    assert [(b.section, b.code, b.skip) for b in blocks] == [("A", "x = 1", None), ("A", "load()", "needs weights")]


@pytest.mark.parametrize("section", SECTIONS)
def test_readme_section_runs(section):
    torch.manual_seed(0)
    namespace = setup_namespace(section)
    ran = 0
    for block in BLOCKS:
        if block.section != section or block.skip is not None:
            continue
        # Pad so that a traceback names the README's own line numbers.
        exec(compile("\n" * block.line + block.code, str(README), "exec"), namespace)
        ran += 1
    if ran == 0:
        pytest.skip("every block of this section is marked as not run")


def test_the_package_docstring_usage_runs():
    import diffusers_causal_kv

    after = diffusers_causal_kv.__doc__.split("::\n", 1)[1].splitlines()
    end = next(i for i, line in enumerate(after) if line.strip() and not line.startswith("    "))
    usage = "\n".join(after[:end])
    namespace = setup_namespace("(package docstring)")
    exec(textwrap.dedent(usage), namespace)
    assert namespace["latents"].shape == namespace["noise"].shape
