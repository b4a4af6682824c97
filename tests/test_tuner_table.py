"""Tables written by `kgen tune`: round trip, merging, corrupt files, Triton version check."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kgen.blockconfig import (
    TABLE_DIR,
    BlockConfig,
    Measured,
    TableEntry,
    TableFile,
    TableMetadata,
    check_triton_version,
    read_table,
    table_to_json,
)
from kgen.errors import TableError
from kgen.spec import load_layouts
from kgen.tuner.errors import TuneError
from kgen.tuner.job import TuneJob
from kgen.tuner.results import JobResult, entry_for, format_results, merge_entries, write_results
from kgen.tuner.workloads import load_workloads

LAYOUTS = load_layouts()
WORKLOADS = load_workloads()
DEFAULT = BlockConfig(block_h=8, block_n=64, num_warps=8, num_stages=2)
TUNED = BlockConfig(block_h=4, block_n=32, num_warps=4, num_stages=3)


def result(bucket: str = "b2-8", group: int = 8, replaced: bool = True, arch: str = "sm_90") -> JobResult:
    b = WORKLOADS.bucket_named(bucket)
    job = TuneJob(arch, LAYOUTS["gqa128"], "bfloat16", "bfloat16", group, b, tuple(WORKLOADS.workloads(b)))
    chosen = TUNED if replaced else DEFAULT
    return JobResult(
        job=job,
        study_name="s",
        finished=100,
        pruned=20,
        default=DEFAULT,
        default_us=120.0,
        default_error=None,
        noise_pct=1.5,
        chosen=chosen,
        chosen_us=100.0 if replaced else 120.0,
        replaced=replaced,
    )


def entry(batch_min: int, batch_max: int, group: int = 8, layout: str = "gqa128") -> TableEntry:
    return TableEntry(
        layout=layout, kv_dtype="bfloat16", group_size=group, batch_min=batch_min, batch_max=batch_max, config=DEFAULT
    )


def test_write_read_round_trip_with_metadata_and_measurements(tmp_path: Path) -> None:
    out = tmp_path / "sm_90.json"
    table, changed = write_results(out, "sm_90", "NVIDIA H200", [result(), result("b97+", replaced=False)])
    assert changed
    back = read_table(out)
    assert back == table
    meta = back.metadata
    assert (meta.gpu_name, meta.arch, meta.tuned, meta.trials) == ("NVIDIA H200", "sm_90", True, 200)
    assert meta.triton_version and meta.torch_version and re.match(r"\d{4}-\d\d-\d\dT", meta.date)
    first = back.lookup("gqa128", "bfloat16", 8, 4)
    assert first.config == TUNED
    assert first.measured == Measured(
        tuned_us=100.0,
        default_us=120.0,
        noise_pct=1.5,
        workloads=[w.model_dump() for w in WORKLOADS.workloads(WORKLOADS.bucket_named("b2-8"))],
        gpu_name="NVIDIA H200",
    )
    assert back.lookup("gqa128", "bfloat16", 8, 5000).config == DEFAULT  # the open-ended last bucket
    assert back.lookup("gqa128", "bfloat16", 8, 20) is None  # bucket not tuned in this run
    # fp16 KV has no rows: the row a call runs, and the tuner's current config, is bf16's (TWIN_KV).
    assert back.lookup("gqa128", "float16", 8, 4).config == TUNED
    assert back.lookup("gqa128", "float8_e4m3fn", 8, 4) is None
    assert meta.note == ("kgen tune on NVIDIA H200: 2 entries measured in this run from 2 studies "
                         "(200 finished trials, 1 worker)")
    write_results(out, "sm_90", "NVIDIA H100 80GB HBM3", [result("b9-32")], workers=2)
    merged = read_table(out)
    assert merged.metadata.trials == 300 and len(merged.entries) == 3
    assert merged.metadata.note.endswith("from 1 study (100 finished trials, 2 workers)")
    # Each row keeps the GPU it was measured on; the metadata names the last run's.
    assert merged.metadata.gpu_name == "NVIDIA H100 80GB HBM3"
    assert merged.lookup("gqa128", "bfloat16", 8, 20).measured.gpu_name == "NVIDIA H100 80GB HBM3"
    assert merged.lookup("gqa128", "bfloat16", 8, 4).measured.gpu_name == "NVIDIA H200"


def test_a_run_on_another_gpu_keeps_where_older_rows_were_measured(tmp_path: Path) -> None:
    """A row written before measured.gpu_name existed was measured on the GPU its table's
    metadata names; a run on another GPU replaces that metadata, so the row gets the name first."""
    out = tmp_path / "sm_90.json"
    table, _ = write_results(out, "sm_90", "NVIDIA H200", [result()])
    old = table.entries[0]
    unnamed = old.model_copy(update={"measured": old.measured.model_copy(update={"gpu_name": None})})
    out.write_text(table_to_json(table.model_copy(update={"entries": [unnamed]})))
    write_results(out, "sm_90", "NVIDIA H100 80GB HBM3", [result("b9-32")])
    merged = read_table(out)
    assert merged.metadata.gpu_name == "NVIDIA H100 80GB HBM3"
    assert merged.lookup("gqa128", "bfloat16", 8, 4).measured.gpu_name == "NVIDIA H200"
    assert merged.lookup("gqa128", "bfloat16", 8, 20).measured.gpu_name == "NVIDIA H100 80GB HBM3"


def test_merge_replaces_matching_buckets_and_keeps_the_rest() -> None:
    old = [entry(1, 1 << 30), entry(1, 1 << 30, group=16), entry(1, 1 << 30, layout="gqa64")]
    new = [entry(9, 32).model_copy(update={"config": TUNED})]
    merged = merge_entries(old, new)
    g8 = [(e.batch_min, e.batch_max, e.config) for e in merged if e.layout == "gqa128" and e.group_size == 8]
    assert g8 == [(1, 8, DEFAULT), (9, 32, TUNED), (33, 1 << 30, DEFAULT)]
    assert sum(1 for e in merged if e.group_size == 16) == 1
    assert sum(1 for e in merged if e.layout == "gqa64") == 1
    again = merge_entries(merged, [entry(1, 1 << 30).model_copy(update={"config": TUNED})])
    assert [(e.batch_min, e.config) for e in again if e.layout == "gqa128" and e.group_size == 8] == [(1, TUNED)]


def test_merging_into_an_existing_table_of_another_arch_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    write_results(out, "gfx950", "MI355X", [result(arch="gfx950")])
    with pytest.raises(TuneError, match="holds the table of gfx950, not sm_90"):
        write_results(out, "sm_90", "H200", [result()])


def test_rocm_knobs_are_dropped_from_cuda_entries() -> None:
    r = result()
    r.chosen = TUNED.model_copy(update={"waves_per_eu": 2, "matrix_instr_nonkdim": 16, "kpack": 1})
    assert entry_for(r).config == TUNED


def test_closing_table_shows_default_and_tuned() -> None:
    text = format_results([result(), result("b97+", replaced=False)])
    assert "120.00" in text and "100.00" in text and "1.200x" in text
    assert "kept default" in text and "tuned configs:" in text


# ----------------------------------------------------------------- corrupt tables


def shipped() -> dict:
    return json.loads((TABLE_DIR / "sm_90.json").read_text())


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda t: "{ not json", r"not valid JSON"),
        (
            lambda t: {**t, "entries": [{**t["entries"][0], "blokc_n": 64}, *t["entries"][1:]]},
            r"field 'entries\.0\.blokc_n'",
        ),
        (lambda t: {**t, "entries": [{**t["entries"][0], "group_size": "four"}]}, r"field 'entries\.0\.group_size'"),
        (lambda t: {**t, "schema": "kgen.block-config-table/0"}, r"field 'schema'"),
        (
            lambda t: {**t, "entries": [{**t["entries"][0], "config": {**t["entries"][0]["config"], "block_n": 48}}]},
            r"field 'entries\.0\.config\.block_n'.*power of two",
        ),
        (lambda t: {**t, "metadata": {**t["metadata"], "arch": "gfx950"}}, r"metadata\.arch"),
        (
            lambda t: {**t, "entries": [{**t["entries"][0], "config": {
                **t["entries"][0]["config"], "split": {"max_splits": 16, "merge_pipelined": True}}}]},
            r"field 'entries\.0\.config\.split'.*merge_pipelined pipelines the merge in a cluster: set split\.merge",
        ),
    ],
)
def test_corrupt_tables_are_rejected_naming_file_and_field(tmp_path: Path, mutate, pattern: str) -> None:
    path = tmp_path / "gfx950.json"
    bad = mutate(shipped())
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(TableError, match=pattern) as info:
        read_table(path)
    assert str(path) in str(info.value)


def test_tune_refuses_to_merge_into_a_corrupt_table(tmp_path: Path) -> None:
    path = tmp_path / "sm_90.json"
    path.write_text("{")
    with pytest.raises(TableError, match=re.escape(str(path))):
        write_results(path, "sm_90", "H200", [result()])
    assert path.read_text() == "{"


# ----------------------------------------------------------------- Triton version


def table_made_with(version: str | None) -> TableFile:
    meta = TableMetadata(arch="sm_90", gpu_name="NVIDIA H200", triton_version=version, tuned=True)
    return TableFile.model_validate(
        {"schema": "kgen.block-config-table/1", "arch": "sm_90", "metadata": meta.model_dump(), "entries": []}
    )


def test_table_from_another_triton_minor_warns() -> None:
    msg = check_triton_version(table_made_with("3.5.1"), installed="3.6.0", source="kgen/tables/sm_90.json")
    assert msg and "kgen/tables/sm_90.json" in msg and "3.5.1" in msg and "3.6.0" in msg
    assert "kgen tune --arch sm_90" in msg


def test_same_major_minor_or_no_version_does_not_warn() -> None:
    assert check_triton_version(table_made_with("3.6.0"), installed="3.6.1+git1234") is None
    assert check_triton_version(table_made_with(None), installed="3.6.0") is None
    assert check_triton_version(table_made_with("3.6.0"), installed="") is None


def test_schema_doc_lists_every_field() -> None:
    doc = (TABLE_DIR / "SCHEMA.md").read_text()
    from kgen.blockconfig import GluonConfig, SplitPolicy

    for model in (TableFile, TableMetadata, TableEntry, BlockConfig, GluonConfig, SplitPolicy, Measured):
        for name, field in model.model_fields.items():
            assert f"`{field.alias or name}`" in doc, f"SCHEMA.md does not document {model.__name__}.{name}"
