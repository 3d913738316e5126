"""Pages whose source lives outside docs/: the notebooks, the changelog and the regression scheduling notes.

mkdocs only reads docs/, so this hook adds those files to the build (read where they are, never copied into the
repository) and fills the nav's "Notebooks" section with every notebooks/*.ipynb, titled by its first heading:
a new notebook appears in the site without editing mkdocs.yml. mkdocs-jupyter renders the notebooks with their
saved outputs (`execute: false` in mkdocs.yml).
"""

from __future__ import annotations

import json
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


@event_priority(
    50
)  # before mkdocs-jupyter's on_files (priority 0), which turns .ipynb files into pages
def on_files(files, config):
    for nb in _notebooks():
        # a plain File read from the repository root (mkdocs-jupyter's wrapper needs its src_dir)
        files.append(
            File(
                f"notebooks/{nb.name}",
                src_dir=str(ROOT),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    for site_path, source in MARKDOWN.items():
        files.append(File.generated(config, site_path, content=source.read_text(encoding="utf-8")))
    return files
