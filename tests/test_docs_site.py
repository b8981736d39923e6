"""The documentation site (``mkdocs.yml``, ``docs/``): ``mkdocs build --strict`` passes (no broken link or anchor, no
docstring that documents a parameter its signature lacks), the built site fetches nothing from the network, the API
reference documents every public name, and every ```python block of every page under ``docs/`` runs (as
``tests/test_readme.py`` runs the README's; ``tests/markdown_blocks.py`` reads and runs them)."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import griffe
import pytest
from markdown_blocks import FENCE, check_blocks, run_section, sections

import diffusers_causal_kv
import diffusers_causal_kv.modular

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(page for page in DOCS.rglob("*.md") if FENCE.search(page.read_text()))
# What the reference documents beyond ``diffusers_causal_kv.__all__``: the converter and the Modular classes.
ALSO_DOCUMENTED = [
    "diffusers_causal_kv.convert.convert_checkpoint",
    *(f"diffusers_causal_kv.modular.{name}" for name in diffusers_causal_kv.modular.__all__
      if name[0].isupper() and not name.isupper()),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built by ``mkdocs build --strict`` into a temporary folder."""
    missing = [name for name in ("mkdocs", "material", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(name.split(".")[0]) is None or importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the docs toolchain is not installed ({', '.join(missing)}): pip install -e '.[docs]'")
    site_dir = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                           cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    warnings = [line for line in build.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert build.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(warnings or [build.stderr[-4000:]])
    return site_dir


def test_the_site_builds_strictly_with_every_page(site):
    for page in DOCS.rglob("*.md"):
        built = site / page.relative_to(DOCS).with_suffix(".html")
        assert built.is_file(), f"{page.relative_to(ROOT)} was not built (is it in mkdocs.yml's nav?)"


def test_the_built_site_fetches_nothing_from_the_network(site):
    """No web fonts, analytics, remote scripts or stylesheets: the site reads from the file system alone."""
    remote = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=[\"'](?:https?:)?//", re.IGNORECASE)
    fetched = {}
    for path in site.rglob("*"):
        if path.suffix in {".html", ".css", ".js"}:
            text = path.read_text(errors="replace")
            hits = remote.findall(text) + re.findall(r"@import\s+url\(\s*[\"']?(?:https?:)?//", text)
            hits += re.findall(r"fonts\.(?:googleapis|gstatic)\.com", text)
            if hits:
                fetched[str(path.relative_to(site))] = hits[:3]
    assert fetched == {}


def test_the_api_reference_documents_every_public_name():
    directives = "\n".join(page.read_text() for page in (DOCS / "reference").glob("*.md"))
    documented = set(re.findall(r"^::: ([\w.]+)", directives, flags=re.MULTILINE))
    wanted = [f"diffusers_causal_kv.{name}" for name in diffusers_causal_kv.__all__] + ALSO_DOCUMENTED
    assert [name for name in wanted if name not in documented] == []


def _docstring_extension():
    spec = importlib.util.spec_from_file_location("sphinx_roles", DOCS / "_griffe" / "sphinx_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docstring_extension_rewrites_roles_and_checks_each_grouped_parameter(caplog):
    source = '''
def rollout(a, b, *, c=None):
    """Roll out with :class:`~pkg.Engine` and :func:`rollout`; see :mod:`.engines`::

        rollout(1, 2)

    Args:
        a / b: the inputs.
        c, d: options.
    """


class Engine:
    """Stores K/V.

    Reads
        Over a fresh tensor.
    """
'''
    extension = _docstring_extension().SphinxRoles()
    with caplog.at_level(logging.WARNING, logger="griffe"), griffe.temporary_visited_package(
        "pkg", {"__init__.py": source}, extensions=griffe.load_extensions(extension)
    ) as pkg:
        rollout, engine = pkg["rollout"].docstring.value, pkg["Engine"].docstring.value
    assert '<autoref identifier="pkg.Engine" optional>`Engine`</autoref>' in rollout
    assert '<autoref identifier="pkg.rollout" optional>`rollout()`</autoref>' in rollout
    assert '<autoref identifier="pkg.engines" optional>`engines`</autoref>:\n' in rollout
    assert "Reads\n:   Over a fresh tensor." in engine
    assert [record.getMessage().split(": ", 1)[1] for record in caplog.records] == [
        "Parameter 'd' does not appear in the signature of pkg.rollout"
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(DOCS)))
def test_docs_page_runs(page):
    blocks = check_blocks(page)
    if sum(run_section(page, blocks, section) for section in sections(blocks)) == 0:
        pytest.skip("every block of this page is marked as not run")
