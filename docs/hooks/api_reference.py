"""The Python API reference: one mkdocstrings block per public name of `import workbench as wb`.

The public names are workbench/__init__.py's `_HOMES` (each name and the module it lives in) and its public
subpackages (`_PACKAGES`); a page holding the marker below gets a `::: module.Name` block for each, which
mkdocstrings renders from the docstrings. A name added to workbench/__init__.py appears without editing the docs.
"""

from __future__ import annotations

MARKER = "<!-- generated: api-reference -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, api_reference())
    return markdown


def api_reference() -> str:
    import workbench

    blocks = [f"::: {module}.{name}\n" for name, module in workbench._HOMES.items()]
    for (
        package
    ) in workbench._PACKAGES:  # wb.data, wb.tasks: their own names, not those documented above
        names = [n for n in getattr(workbench, package).__all__ if n not in workbench._HOMES]
        members = "".join(f"\n        - {n}" for n in names)
        blocks.append(f"::: workbench.{package}\n    options:\n      members:{members}\n")
    return "\n".join(blocks)
