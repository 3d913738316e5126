"""The Python API reference: a page per public object of `import workbench as wb`, under Reference > Python API.

The public names are workbench/__init__.py's `_HOMES` (each name and the module it lives in) and its public
subpackages (`_PACKAGES`). Each gets a generated page, reference/api/<name>.md, holding one mkdocstrings block
(`::: module.Name`) that is rendered from the docstrings; the exceptions share one page. The overview page
(docs/reference/api.md) gets a table of them all at its marker, and the nav's "Python API" entry becomes a
section of the overview and the pages. RunConfig's page documents its methods and properties only: its fields
are on the RunConfig fields page (reference/config.md), once. A name added to workbench/__init__.py appears
without editing the docs.
"""

from __future__ import annotations

import dataclasses
import inspect

from mkdocs.structure.files import File

MARKER = "<!-- generated: api-reference -->"
OVERVIEW = "reference/api.md"
NAV_TITLE = "Python API"
ERRORS = "errors"
"""The page the exceptions share (each is a short class whose docstring says when it is raised)."""


def _objects() -> dict[str, list[str]]:
    """Page name: the public names it documents, in workbench/__init__.py's order."""
    import workbench

    pages: dict[str, list[str]] = {}
    for name in workbench._HOMES:
        obj = getattr(workbench, name)
        is_error = inspect.isclass(obj) and issubclass(obj, BaseException)
        pages.setdefault(ERRORS if is_error else name.lower(), []).append(name)
    for package in workbench._PACKAGES:
        pages[package] = [package]
    return pages


def _title(page: str, names: list[str]) -> str:
    if page == ERRORS:
        return "Errors"
    return f"wb.{names[0]}"


def _summary(obj: object) -> str:
    """The docstring's first sentence (its first paragraph, joined), for the overview table."""
    doc = inspect.getdoc(obj) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.replace("|", "\\|")


def _runconfig_members() -> list[str]:
    """RunConfig's public methods and properties: everything but the dataclass fields."""
    from workbench.config import RunConfig

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    return [n for n in vars(RunConfig) if not n.startswith("_") and n not in fields]


def page_markdown(page: str, names: list[str]) -> str:
    import workbench

    lines = [f"# {_title(page, names)}\n"]
    if page == ERRORS:
        lines.append("What `wb.launch`, `wb.start`, `Run.wait` and the run directory raise.\n")
    for name in names:
        if name in workbench._PACKAGES:
            own = [n for n in getattr(workbench, name).__all__ if n not in workbench._HOMES]
            members = "".join(f"\n        - {n}" for n in own)
            lines.append(
                f"::: workbench.{name}\n    options:\n      show_root_heading: false\n"
                f"      members:{members}\n"
            )
            continue
        module = workbench._HOMES[name]
        if name == "RunConfig":
            lines.append(
                "Its fields (every setting of a run, with its default and what it accepts) are on "
                "[RunConfig fields](../config.md); below are its methods and properties.\n"
            )
            members = "".join(f"\n        - {n}" for n in _runconfig_members())
            lines.append(
                f"::: {module}.{name}\n    options:\n      show_root_heading: false\n"
                f"      members:{members}\n"
            )
        else:
            heading = "true" if page == ERRORS else "false"
            lines.append(f"::: {module}.{name}\n    options:\n      show_root_heading: {heading}\n")
    return "\n".join(lines)


def overview_table() -> str:
    import workbench

    rows = ["| Name | What it is |", "| --- | --- |"]
    for page, names in _objects().items():
        for name in names:
            summary = _summary(getattr(workbench, name))
            rows.append(f"| [`wb.{name}`](api/{page}.md) | {summary} |")
    return "\n".join(rows) + "\n"


def on_config(config):
    """The nav's "Python API" entry (anywhere in it) becomes the overview and a page per object."""
    entries = [{"Overview": OVERVIEW}] + [
        {_title(page, names): f"reference/api/{page}.md"} for page, names in _objects().items()
    ]

    def visit(items) -> bool:
        for i, item in enumerate(items or []):
            if isinstance(item, dict):
                for key, value in item.items():
                    if key == NAV_TITLE and value == OVERVIEW:
                        items[i] = {NAV_TITLE: entries}
                        return True
                    if isinstance(value, list) and visit(value):
                        return True
        return False

    visit(config.nav)
    return config


def on_files(files, config):
    for page, names in _objects().items():
        files.append(
            File.generated(config, f"reference/api/{page}.md", content=page_markdown(page, names))
        )
    return files


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, overview_table())
    return markdown
