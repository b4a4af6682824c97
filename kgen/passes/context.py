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
from kgen.errors import UsageError
from kgen.locations import GENERATED_ENV, INSTALLED_DIR, source_generated_dir
from kgen.targets import Target, read_targets
from kgen.version import __version__

# Paths written into a module's header (its spec, its tables) are relative to this folder.
REPO_ROOT = Path(__file__).resolve().parents[2]


def default_out_dir(check_only: bool = False) -> Path:
    """Where ``kgen build`` writes without ``--out``: the repository's ``generated/``.

    Outside a source checkout there is no such folder and the package's own directory is
    site-packages, which a build must never write into: writing then needs an explicit
    ``--out``. A check-only build (it writes nothing) compares with the installed copy.
    """
    source = source_generated_dir()
    if source is not None:
        return source
    if check_only:
        return INSTALLED_DIR
    raise UsageError(
        "kgen is not running from a source checkout, so there is no generated/ to write to; "
        f"pass --out DIR (kgen build --out DIR, or out_dir=) and set {GENERATED_ENV}=DIR so kgen.load finds "
        "the modules"
    )


@dataclass(frozen=True)
class BuildContext:
    tables: dict[str, TableSource]
    defaults: DefaultsFile
    out_dir: Path
    check_only: bool = False
    kgen_version: str = "0.1.0"
    triton_version: str | None = None  # installed, for the tables' version check
    targets: dict[str, Target] | None = None  # kgen/tables/targets.json: what modules are checked for


def load_context(out_dir: Path | None = None, check_only: bool = False,
                 table_dir: Path = TABLE_DIR, env: dict[str, str] | None = None) -> BuildContext:
    env = os.environ if env is None else env
    return BuildContext(
        tables=resolve_tables(table_dir, env),
        defaults=read_defaults(),
        out_dir=Path(out_dir) if out_dir else default_out_dir(check_only),
        check_only=check_only,
        kgen_version=__version__,
        triton_version=installed_triton_version(),
        targets=read_targets(),
    )
