"""mkdocs-gen-files script (mkdocs.yml): writes the generated reference pages into the site at build time."""

from __future__ import annotations

import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_reference import config_page, errors_page, exit_codes_page

PACKAGE = Path(__file__).resolve().parents[1] / "ignite_mgpu"

PAGES = {
    "reference/config.md": config_page(),
    "reference/exit-codes.md": exit_codes_page(),
    "reference/errors.md": errors_page(PACKAGE),
}
for name, text in PAGES.items():
    with mkdocs_gen_files.open(name, "w") as page:
        page.write(text)
