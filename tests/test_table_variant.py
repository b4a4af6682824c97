"""benchmarks/table_variant.py: the variant table of an A/B changes exactly the rows and keys its
command line names, drops their measurements, and refuses what kgen.load would not read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_tools import load_tool

from kgen.blockconfig import read_table
from kgen.errors import UsageError

SPLIT = {"programs_per_sm": 4, "max_splits": 8, "min_tokens_per_split": 512}
GLUON = {"block_n": 128, "num_stages": 4, "lazy_rescale": False, "from_rows": 64,
         "split": {"programs_per_sm": 1, "max_splits": 64, "min_tokens_per_split": 128}}


def _tool():
    return load_tool("table_variant")


def _row(layout: str, group: int, batch_min: int, batch_max: int, **config) -> dict:
    base = {"block_h": 4, "block_n": 64, "num_warps": 2, "num_stages": 3, "split": dict(SPLIT)}
    return {"layout": layout, "kv_dtype": "bfloat16", "group_size": group, "batch_min": batch_min,
            "batch_max": batch_max, "config": {**base, **config},
            "measured": {"tuned_us": 66.2, "default_us": 71.3, "noise_pct": 0.3, "workloads": []}}


@pytest.fixture
def tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A $KGEN_TABLES_DIR holding a small sm_90 table: two GQA 64 rows and one GQA 256 row."""
    table = {"schema": "kgen.block-config-table/1", "arch": "sm_90", "metadata": {"arch": "sm_90"},
             "entries": [_row("gqa64", 8, 1, 1), _row("gqa64", 8, 33, 96, gluon=GLUON),
                         _row("qwen3_5_gqa256", 16, 9, 32, lazy_rescale=True)]}
    folder = tmp_path / "tables"
    folder.mkdir()
    (folder / "sm_90.json").write_text(json.dumps(table))
    read_table(folder / "sm_90.json")  # the fixture itself is a valid table
    monkeypatch.setenv("KGEN_TABLES_DIR", str(folder))
    monkeypatch.delenv("KGEN_TABLE", raising=False)
    return folder / "sm_90.json"


def _entries(path: Path) -> list[dict]:
    return json.loads(Path(path).read_text())["entries"]


def test_only_the_named_keys_of_the_named_row_change(tables: Path, tmp_path: Path) -> None:
    out = tmp_path / "variant"
    assert _tool().main(["--out", str(out), "--row", "gqa64:bf16:8:33-96", "split.max_splits=1", "gluon.from_rows=0",
                         "--row", "qwen3_5_gqa256:bf16:16:9-32", "draft_tile=first", "lazy_rescale=null"]) == 0
    before, after = _entries(tables), _entries(out / "sm_90.json")
    assert after[0] == before[0]  # the row no edit names, measurement and all
    assert after[1]["config"] == {**before[1]["config"], "split": {**SPLIT, "max_splits": 1},
                                  "gluon": {**GLUON, "from_rows": 0}}
    expected = {k: v for k, v in before[2]["config"].items() if k != "lazy_rescale"}
    assert after[2]["config"] == {**expected, "draft_tile": "first"}
    assert "measured" not in after[1] and "measured" not in after[2]
    note = read_table(out / "sm_90.json").metadata.note  # what kgen.load reads
    assert note.startswith("variant of the KGEN_TABLES_DIR sm_90 table: gqa64:bf16:8:33-96 split.max_splits=1")


def test_a_whole_section_given_as_json(tables: Path) -> None:
    section = {**GLUON, "block_n": 64, "num_stages": 2, "from_rows": 0}
    variant = _tool().make_variant(tables, [["qwen3_5_gqa256:bf16:16:9-32", "gluon=" + json.dumps(section)]])
    row = variant.lookup("qwen3_5_gqa256", "bfloat16", 16, 16)
    assert row.config.gluon is not None and (row.config.gluon.block_n, row.config.gluon.from_rows) == (64, 0)


@pytest.mark.parametrize("row, edit, says", [
    ("gqa64:bf16:8:9-32", "num_warps=4", "no row for batches 9-32 (rows there: 1, 33-96)"),
    ("gqa64:bf16:eight:33-96", "num_warps=4", "expected LAYOUT:KV:GROUP:BATCHES"),
    ("gqa64:bf17:8:33-96", "num_warps=4", "unknown KV dtype 'bf17'"),
    ("gqa64:bf16:8:33-96", "num_warps", "expected KEY=VALUE"),
    ("gqa64:bf16:8:33-96", "splits.max_splits=1", "no section 'splits'"),
    ("gqa64:bf16:8:33-96", "split.max_splits=0", "split.max_splits"),
    ("gqa64:bf16:8:33-96", 'num_warps="4"', "num_warps"),
    ("gqa64:bf16:8:33-96", None, "at least one KEY=VALUE"),
])
def test_a_wrong_row_or_edit_is_refused_by_name(tables: Path, row: str, edit: str | None, says: str) -> None:
    with pytest.raises(UsageError) as caught:
        _tool().make_variant(tables, [[row] + ([edit] if edit else [])])
    assert says in str(caught.value)


def test_it_never_writes_over_the_table_it_reads(tables: Path, capsys: pytest.CaptureFixture) -> None:
    before = tables.read_bytes()
    assert _tool().main(["--out", str(tables.parent), "--row", "gqa64:bf16:8:33-96", "num_warps=4"]) == 2
    assert "holds the table it reads" in capsys.readouterr().err
    assert tables.read_bytes() == before
