"""Read-only inputs of a build besides the plan: tables, defaults, output directory.

Reading files happens once, here, before the passes run; the passes stay pure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kgen.blockconfig import (
    TABLE_DIR,
    DefaultsFile,
    TableSource,
    installed_triton_version,
    read_defaults,
    resolve_tables,
)
from kgen.targets import Target, read_targets

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "generated"


@dataclass(frozen=True)
class BuildContext:
    tables: dict[str, TableSource]
    defaults: DefaultsFile
    out_dir: Path = DEFAULT_OUT_DIR
    check_only: bool = False
    kgen_version: str = "0.1.0"
    triton_version: str | None = None  # installed, for the tables' version check
    targets: dict[str, Target] | None = None  # kgen/tables/targets.json: what modules are checked for


def load_context(out_dir: Path | None = None, check_only: bool = False,
                 table_dir: Path = TABLE_DIR, env: dict[str, str] | None = None) -> BuildContext:
    from kgen import __version__

    env = os.environ if env is None else env
    return BuildContext(
        tables=resolve_tables(table_dir, env),
        defaults=read_defaults(),
        out_dir=Path(out_dir) if out_dir else DEFAULT_OUT_DIR,
        check_only=check_only,
        kgen_version=__version__,
        triton_version=installed_triton_version(),
        targets=read_targets(),
    )
