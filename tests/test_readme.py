"""Every ```python block of README.md runs here, so the README cannot drift from the package.

The blocks of one ``## `` section run in order in one namespace, which starts as
``diffusers_causal_kv.testing.doc_namespace()`` (tiny random objects under the names the README leaves to the reader);
``tests/markdown_blocks.py`` reads the blocks and runs them, as it does for the pages under ``docs/``. A block that
cannot run here is marked in the README by an HTML comment on the line before its fence,
``<!-- readme-test: skip: the reason -->``; a skip without a reason fails.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from markdown_blocks import check_blocks, python_blocks, run_section, sections

from diffusers_causal_kv.testing import doc_namespace

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = python_blocks(README.read_text())


def test_every_python_block_is_found_and_every_skip_has_a_reason():
    assert len(check_blocks(README)) >= 3


def test_the_extractor_reads_indented_fences_and_skip_markers():
    blocks = python_blocks("## A\n\n* item:\n\n  ```python\n  x = 1\n  ```\n\n"
                           "<!-- readme-test: skip: needs weights -->\n```python\nload()\n```\n"
                           "## B\n```bash\nls\n```\n")
    assert [(b.section, b.code, b.skip) for b in blocks] == [("A", "x = 1", None), ("A", "load()", "needs weights")]


@pytest.mark.parametrize("section", sections(BLOCKS))
def test_readme_section_runs(section, tmp_path, monkeypatch):
    # As written, from the repository root (the Quickstart loads models/tiny-sprites and writes an mp4): in a folder
    # of its own that sees the repository's models.
    (tmp_path / "models").symlink_to(README.parent / "models")
    monkeypatch.chdir(tmp_path)
    if run_section(README, BLOCKS, section) == 0:
        pytest.skip("every block of this section is marked as not run")
    if section == "Quickstart":  # the video it promises
        assert (tmp_path / "red_ball.mp4").stat().st_size > 0


def test_the_package_docstring_usage_runs():
    import diffusers_causal_kv

    after = diffusers_causal_kv.__doc__.split("::\n", 1)[1].splitlines()
    end = next(i for i, line in enumerate(after) if line.strip() and not line.startswith("    "))
    usage = "\n".join(after[:end])
    namespace = doc_namespace()
    exec(textwrap.dedent(usage), namespace)
    assert namespace["latents"].shape == namespace["noise"].shape

