"""A griffe extension for the API reference: the package's docstrings, written for Sphinx, as mkdocstrings reads them.

The docstrings cross-reference with reStructuredText roles (``:class:`~diffusers_causal_kv.CausalContext```,
``:meth:`crop```), introduce literal blocks with ``::`` and document related parameters together in one ``Args:``
entry (``image / image_embeds: ...``). Once the package is loaded, this extension:

* turns each role into an optional mkdocs-autorefs reference: a link where the target is documented in the
  reference, code text where it is not (an internal module, a private helper), never a warning. Targets resolve as
  in Sphinx: a leading ``~`` shows the last component only, a leading ``.`` is relative to the module, a bare name
  is looked up in the scope of the documented object;
* ends a paragraph that ends in ``::`` with ``:`` (the indented block after it already is a Markdown code block);
* writes reStructuredText definition lists (a term line, its definition indented below it) in the syntax of the
  ``def_list`` Markdown extension (``:   definition``), where an indented block would otherwise read as code;
* checks every name of every ``Args:`` entry, grouped (``a / b``, ``a, b``) or not, against the signature, and logs
  a warning for a name the signature does not have (``mkdocs build --strict`` fails on it). griffe's own check,
  which reads ``a / b`` as one unknown name, is turned off in ``mkdocs.yml`` (``warn_unknown_params: false``).

Line numbers are kept: a role split over two lines leaves its line break after the reference.
"""

from __future__ import annotations

import logging
import re

import griffe

ROLE = re.compile(r":(func|meth|class|attr|data|mod|exc|obj):`(~?)([^`]+?)`", re.DOTALL)
LITERAL_BLOCK = re.compile(r"(?<=\S)::(?=\n[ \t]*\n)")
GROUP_SEPARATOR = re.compile(r"\s*[/,]\s*")
LIST_ITEM = re.compile(r"^\s*(?:[*+-]|\d+[.)])\s")

logger = logging.getLogger("griffe")


def _module(obj: griffe.Object) -> griffe.Module:
    while not obj.is_module:
        obj = obj.parent
    return obj


def _resolve(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as written in ``obj``'s docstring (the target itself where unresolvable)."""
    if target.startswith("."):
        return _module(obj).path + target
    head, _, rest = target.partition(".")
    scope = obj if obj.is_module or obj.is_class else obj.parent
    try:
        path = scope.resolve(head)
    except (griffe.NameResolutionError, AttributeError):
        return target
    return f"{path}.{rest}" if rest else path


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _definition_lists(text: str) -> str:
    """Each term (an unindented line, not a list item nor a section title, right after a blank or indented line and
    right before an indented one) keeps its line; the first line of its definition starts with ``:   ``."""
    lines = text.splitlines()
    for i in range(1, len(lines) - 1):
        line, before, after = lines[i], lines[i - 1], lines[i + 1]
        is_term = (line.strip() and _indent(line) == 0 and not LIST_ITEM.match(line) and not line.endswith(":")
                   and (not before.strip() or _indent(before) > 0) and after.strip() and _indent(after) > 0)
        if is_term:
            lines[i + 1] = ":   " + after.lstrip()
    return "\n".join(lines)


def _rewrite(obj: griffe.Object, text: str) -> str:
    def reference(match: re.Match) -> str:
        role, short, written = match.groups()
        target = re.sub(r"\s+", "", written)
        title = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
        if role in ("func", "meth"):
            title += "()"
        line_breaks = "".join(re.findall(r"\n[ \t]*", written))
        return f'<autoref identifier="{_resolve(obj, target)}" optional>`{title}`</autoref>{line_breaks}'

    return _definition_lists(LITERAL_BLOCK.sub(":", ROLE.sub(reference, text)))


def _check_parameters(obj: griffe.Object) -> None:
    """Warn for each documented parameter name (alone or in a group) that ``obj``'s signature lacks."""
    try:
        known = {parameter.name for parameter in obj.parameters}
    except (AttributeError, ValueError):
        return
    docstring = obj.docstring
    lines = docstring.value.splitlines()
    for section in griffe.parse_google(docstring, warnings=False):
        if section.kind is not griffe.DocstringSectionKind.parameters:
            continue
        for parameter in section.value:
            for name in GROUP_SEPARATOR.split(parameter.name):
                if name.lstrip("*") in known:
                    continue
                row = next((i for i, line in enumerate(lines) if line.strip().startswith(parameter.name)), 0)
                logger.warning("%s:%d: Parameter '%s' does not appear in the signature of %s",
                               obj.relative_filepath, docstring.lineno + row, name, obj.path)


class SphinxRoles(griffe.Extension):
    """Rewrites and checks every docstring of the loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        seen: set[int] = set()

        def visit(obj: griffe.Object) -> None:
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = _rewrite(obj, obj.docstring.value)
                if obj.is_function or obj.is_class:
                    _check_parameters(obj)
            for member in obj.members.values():
                if not member.is_alias:
                    visit(member)

        visit(pkg)
