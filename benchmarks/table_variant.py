"""Write a copy of an arch's block-config table with some rows changed: the variant side of an
A/B through ``KGEN_TABLES_DIR``, written from a command line that docs can quote.

    python benchmarks/table_variant.py --out /tmp/v \\
        --row gqa64:bf16:8:33-96 split.max_splits=1 num_warps=4 \\
        --row qwen3_5_gqa256:bf16:16:9-32 'gluon={"block_n": 64, "num_stages": 2, "lazy_rescale": false,
              "split": {"programs_per_sm": 1, "max_splits": 64, "min_tokens_per_split": 128}, "from_rows": 0}'
    KGEN_TABLES_DIR=/tmp/v kgen bench --kernels grouped --layout gqa64:8 --batch 64 --prefix 16K \\
        --draft 4 --baseline-tables kgen/tables

A row is named LAYOUT:KV:GROUP:BATCHES, BATCHES as `kgen explain` prints a bucket (``33-96``, ``1``,
``97+``); it must be a row of the table. Each edit is KEY=VALUE: KEY a dotted path into the row's
config, VALUE JSON (a bare word that is not JSON is a string), ``null`` removes the key. The
changed rows lose ``measured`` (the variant is not what was timed), the metadata's note says what
changed, and the table is validated as ``kgen.load`` would read it before it is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kgen.blockconfig import TableError, TableFile, batch_span, read_table, resolve_tables, write_table
from kgen.errors import UsageError, describe_validation
from kgen.spec import KV_DTYPES, canonical_dtype


def parse_row(name: str) -> tuple[str, str, int, str]:
    """LAYOUT:KV:GROUP:BATCHES -> (layout, canonical KV dtype, group, batches)."""
    parts = name.split(":")
    if len(parts) != 4 or not parts[2].isdigit():
        raise UsageError(f"row {name!r}: expected LAYOUT:KV:GROUP:BATCHES, e.g. gqa64:bf16:8:33-96")
    layout, kv, group, batches = parts
    return layout, canonical_dtype(kv, KV_DTYPES, "KV"), int(group), batches


def parse_edit(text: str) -> tuple[list[str], Any]:
    """KEY=VALUE -> (the key's path, the value: JSON, else the bare word as a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise UsageError(f"edit {text!r}: expected KEY=VALUE, KEY a dotted path such as split.max_splits")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key.split("."), parsed


def set_path(config: dict[str, Any], path: list[str], value: Any) -> None:
    """Set (or with None remove) ``config[path[0]][path[1]]...``; the dicts on the way must exist."""
    node = config
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if not isinstance(child, dict):
            raise UsageError(f"{'.'.join(path)}: the row's config has no section {'.'.join(path[: i + 1])!r}; "
                             f"give the whole section as JSON ({'.'.join(path[: i + 1])}={{...}})")
        node = child
    if value is None:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


def find_entry(table: TableFile, raw: dict[str, Any], layout: str, kv: str, group: int,
               batches: str) -> dict[str, Any]:
    """The raw entry the row names (matched on the validated ``table``, whose entries have their
    defaults); an unknown row is an error listing the rows there are."""
    same = [(i, e) for i, e in enumerate(table.entries) if (e.layout, e.kv_dtype, e.group_size) == (layout, kv, group)]
    for i, entry in same:
        if batch_span(entry.batch_min, entry.batch_max) == batches:
            return raw["entries"][i]
    have = ", ".join(batch_span(e.batch_min, e.batch_max) for _, e in same) or "none"
    raise UsageError(f"{layout}:{kv}:{group}: no row for batches {batches} (rows there: {have}); "
                     "a variant changes a row the table has")


def make_variant(source: Path, rows: list[list[str]], origin: str = "") -> TableFile:
    """The table of ``source`` with each ``[ROW, KEY=VALUE...]`` of ``rows`` applied, validated;
    ``origin`` names the source in the metadata's note (default: its path)."""
    table = read_table(source)
    raw = json.loads(source.read_text(encoding="utf-8"))
    notes = []
    for row in rows:
        name, edits = row[0], row[1:]
        if not edits:
            raise UsageError(f"--row {name}: give at least one KEY=VALUE edit")
        entry = find_entry(table, raw, *parse_row(name))
        for edit in edits:
            set_path(entry["config"], *parse_edit(edit))
        entry.pop("measured", None)
        notes.append(f"{name} {' '.join(edits)}")
    raw["metadata"]["note"] = f"variant of {origin or source}: " + "; ".join(notes)
    try:
        return TableFile.model_validate(raw)
    except ValidationError as exc:
        raise UsageError(describe_validation(f"the variant of {origin or source}", exc)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90", help="the table's arch (default sm_90)")
    parser.add_argument("--out", required=True, type=Path, help="folder to write ARCH.json into (for KGEN_TABLES_DIR)")
    parser.add_argument("--row", nargs="+", action="append", required=True, metavar=("ROW", "KEY=VALUE"),
                        help="LAYOUT:KV:GROUP:BATCHES then its edits; repeat for more rows")
    args = parser.parse_args(argv)
    tables = resolve_tables()
    found = tables.get(args.arch)
    if found is None or found.path is None:
        parser.error(f"no table for arch {args.arch!r} (tables: {', '.join(sorted(tables)) or 'none'})")
    source = Path(found.path)
    try:
        variant = make_variant(source, args.row, f"the {found.origin} {args.arch} table")
    except (UsageError, TableError) as exc:
        print(f"table_variant.py: {exc}", file=sys.stderr)
        return 2
    out = args.out / f"{args.arch}.json"
    if out.resolve() == source.resolve():
        print(f"table_variant.py: --out {args.out} holds the table it reads; write the variant elsewhere",
              file=sys.stderr)
        return 2
    write_table(out, variant)
    print(f"{out}: {variant.metadata.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
