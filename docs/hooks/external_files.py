"""Pages whose source lives outside docs/: the notebooks, the changelog and the regression scheduling notes.

mkdocs only reads docs/, so this hook adds those files to the build (read where they are, never copied into the
repository) and fills the nav's "Notebooks" section with every notebooks/*.ipynb, titled by its first heading:
a new notebook appears in the site without editing mkdocs.yml. mkdocs-jupyter renders the notebooks with their
saved outputs (`execute: false` in mkdocs.yml), from a copy of each (in a temporary folder, removed after the
build) without the outputs no page shows: the metrics and curves `wb.record` hands the regression suite
(`application/vnd.workbench.*+json` alone, shown nowhere), which nbconvert would warn about one by one.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
NAV_SECTION = "Notebooks"
MARKDOWN = {
    "changelog.md": ROOT / "CHANGELOG.md",
    "guides/scheduling.md": ROOT / "regress" / "SCHEDULING.md",
}
"""Site path: the repository file whose text it shows."""
UNSHOWN_MIME = "application/vnd.workbench."
"""The MIME types of outputs meant for the regression suite alone (workbench/regress/recording.py)."""
_copies: list[Path] = []
"""Temporary folders holding this build's notebook copies."""


def _notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def _title(notebook: Path) -> str:
    """The notebook's first Markdown heading, else its file name."""
    cells = json.loads(notebook.read_text(encoding="utf-8")).get("cells", [])
    for cell in cells:
        if cell.get("cell_type") == "markdown":
            for line in "".join(cell.get("source", [])).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return notebook.stem.replace("_", " ")


def on_config(config):
    """Every notebook under the nav's "Notebooks" section (added at the end when mkdocs.yml has none)."""
    entries = [{_title(nb): f"notebooks/{nb.name}"} for nb in _notebooks()]
    nav = config.nav if config.nav is not None else []
    for item in nav:
        if isinstance(item, dict) and NAV_SECTION in item:
            item[NAV_SECTION] = entries
            break
    else:
        nav.append({NAV_SECTION: entries})
    config.nav = nav
    return config


def _shown(notebook: Path) -> str:
    """The notebook's JSON without the outputs whose every MIME type is one of workbench's own."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    for cell in nb.get("cells", []):
        if "outputs" in cell:
            cell["outputs"] = [
                o
                for o in cell["outputs"]
                if not (o.get("data") and all(k.startswith(UNSHOWN_MIME) for k in o["data"]))
            ]
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def _remove_copies() -> None:
    while _copies:
        shutil.rmtree(_copies.pop(), ignore_errors=True)


atexit.register(_remove_copies)  # a build that fails before on_post_build leaves none behind either


@event_priority(
    50
)  # before mkdocs-jupyter's on_files (priority 0), which turns .ipynb files into pages
def on_files(files, config):
    copies = Path(tempfile.mkdtemp(prefix="workbench-docs-"))
    _copies.append(copies)
    (copies / "notebooks").mkdir()
    for nb in _notebooks():
        (copies / "notebooks" / nb.name).write_text(_shown(nb), encoding="utf-8")
        # a plain File on disk (mkdocs-jupyter's wrapper needs its src_dir), the copy beside the others
        files.append(
            File(
                f"notebooks/{nb.name}",
                src_dir=str(copies),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    for site_path, source in MARKDOWN.items():
        files.append(File.generated(config, site_path, content=source.read_text(encoding="utf-8")))
    return files


def on_post_build(config):
    _remove_copies()
