"""Tables read at load: `kgen tune --out DIR`, then KGEN_TABLES_DIR=DIR, changes what `kgen explain`
and the launcher choose with no `kgen build`; bad folders and files are errors that name them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import kgen
from kgen import retable
from kgen.blockconfig import TABLE_DIR, read_table, resolve_tables
from kgen.errors import TableError
from kgen.tuner.cli import add_tune_parser, run_tune
from kgen.tuner.errors import TuneError

ROOT = Path(__file__).resolve().parents[1]
LAYOUT, GROUP, BATCH = "gqa64", 8, 4  # the synthetic tune below covers bucket b2-8


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kgen")
    add_tune_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["tune", *argv])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KGEN_TABLE", "KGEN_TABLES_DIR")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _chosen(env: dict[str, str]) -> dict:
    """The config a fresh process's kgen.load(LAYOUT) selects for sm_90, GROUP, BATCH."""
    code = (f"import json, kgen; m = kgen.load({LAYOUT!r}); "
            f"print(json.dumps(m.select_config('sm_90', {GROUP}, {BATCH}), sort_keys=True))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize(("layout", "kv", "variant", "invariant"), [
    ("gqa64", "bfloat16", "grouped", False), ("qwen3_5_gqa256", "bfloat16", "grouped", False),
    ("qwen3_5_gqa256", "float8_e4m3fn", "grouped", False), ("mla_absorbed_512_64", "bfloat16", "grouped", False),
    ("mla_absorbed_512_64", "bfloat16", "grouped", True), ("gqa128", "bfloat16", "per_head", False),
])
def test_the_rows_applied_at_load_are_the_rows_the_build_bakes(layout, kv, variant, invariant, monkeypatch):
    """With the shipped tables, the load-time rows equal the module's baked _BLOCK_CONFIGS: one
    computation of the rows (select_config, then fit), whichever of the two puts them in."""
    monkeypatch.delenv("KGEN_TABLE", raising=False)
    monkeypatch.delenv("KGEN_TABLES_DIR", raising=False)
    module = kgen.load(layout, kv, variant=variant, batch_invariant=invariant)
    plan = retable.planned_configs(layout, kv, "bfloat16", variant, invariant)
    assert retable.module_configs(plan) == module.LAUNCHER.block_configs


def test_a_tuned_folder_changes_the_launcher_and_explain_without_a_build(tmp_path: Path, monkeypatch) -> None:
    tables = tmp_path / "tables"
    shipped_bytes = (TABLE_DIR / "sm_90.json").read_bytes()
    argv = ["--objective", "synthetic", "--arch", "sm_90", "--layout", LAYOUT, "--group", str(GROUP),
            "--kv-dtype", "bf16", "--bucket", "b2-8", "--storage", f"sqlite:///{tmp_path / 'tune.db'}",
            "--out", str(tables), "--no-progress", "--trials", "25"]
    assert run_tune(parse(*argv)) == 0
    written = read_table(tables / "sm_90.json")
    tuned = written.lookup(LAYOUT, "bfloat16", GROUP, BATCH)
    assert tuned is not None and tuned.measured is not None
    # The new file starts from the shipped table: every shipped row of another bucket is kept.
    shipped = read_table(TABLE_DIR / "sm_90.json")
    kept = [e for e in shipped.entries if (e.layout, e.kv_dtype, e.group_size) != (LAYOUT, "bfloat16", GROUP)]
    assert all(e in written.entries for e in kept)

    before, after = _chosen(_env()), _chosen(_env(KGEN_TABLES_DIR=str(tables)))
    assert after != before, "the synthetic optimum equals the shipped choice: the test would prove nothing"
    monkeypatch.setenv("KGEN_TABLES_DIR", str(tables))
    rows = retable.module_configs(retable.planned_configs(LAYOUT, "bfloat16", "bfloat16", "grouped", False))
    assert after == next(c for g, lo, hi, c in rows["sm_90"] if g == GROUP and lo <= BATCH <= hi)

    explain = [sys.executable, "-m", "kgen.cli", "explain", LAYOUT, "--kv-dtype", "bf16", "--pass", "select_config"]
    shown = subprocess.run(explain, env=_env(KGEN_TABLES_DIR=str(tables)), capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "KGEN_TABLES_DIR" in shown.stdout and "sm_90.json" in shown.stdout
    assert (TABLE_DIR / "sm_90.json").read_bytes() == shipped_bytes  # the shipped table is not written


def test_out_takes_a_folder_not_a_file(tmp_path: Path) -> None:
    argv = ["--objective", "synthetic", "--arch", "sm_90", "--layout", LAYOUT, "--group", str(GROUP),
            "--kv-dtype", "bf16", "--bucket", "b2-8", "--storage", f"sqlite:///{tmp_path / 'tune.db'}",
            "--out", str(tmp_path / "sm_90.json"), "--no-progress", "--trials", "3"]
    with pytest.raises(TuneError, match=r"--out takes a folder .*DIR/sm_90\.json"):
        run_tune(parse(*argv))


def test_a_tables_dir_that_is_not_a_folder_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TableError, match=r"KGEN_TABLES_DIR=.*missing is not a directory"):
        resolve_tables(env={"KGEN_TABLES_DIR": str(tmp_path / "missing")})


def test_a_table_file_named_for_another_arch_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "gfx950.json").write_text((TABLE_DIR / "sm_90.json").read_text())
    with pytest.raises(TableError, match=r"gfx950\.json: holds the table of sm_90.*rename it sm_90\.json"):
        resolve_tables(env={"KGEN_TABLES_DIR": str(tmp_path)})


def test_a_row_a_module_cannot_run_is_an_error_at_load(monkeypatch) -> None:
    """Rows that pick the Gluon prefix stage (MLA's shipped sm_90 rows) applied to a module built
    without it are refused when kgen.load applies them, saying what to do, never run on other code."""
    monkeypatch.delenv("KGEN_TABLE", raising=False)
    monkeypatch.delenv("KGEN_TABLES_DIR", raising=False)
    launcher = types.SimpleNamespace(identity=types.SimpleNamespace(gluon_arch=None), block_configs={})
    without_gluon = types.SimpleNamespace(URI="verify_mla_absorbed_512_64__kv_bf16__q_bf16", LAUNCHER=launcher)
    with pytest.raises(TableError, match=r"picks the Gluon prefix stage, which this module was built without: "
                                         r"rebuild it"):
        retable.apply_tables(without_gluon, "mla_absorbed_512_64", "bfloat16", "bfloat16", "grouped", False)
    assert without_gluon.LAUNCHER.block_configs == {}  # nothing half-applied


def test_kgen_check_proves_the_rows_a_tables_dir_puts_in(tmp_path: Path, monkeypatch) -> None:
    """With KGEN_TABLES_DIR set, `kgen check` walks and compiles the rows kgen.load would run,
    not the rows the module was built with."""
    from kgen import check

    table = json.loads((TABLE_DIR / "sm_90.json").read_text())
    row = {"layout": LAYOUT, "kv_dtype": "bfloat16", "group_size": GROUP, "batch_min": 3, "batch_max": 5,
           "config": {"block_h": 8, "block_n": 16, "num_warps": 2, "num_stages": 2}}
    table["entries"] = [row]
    (tmp_path / "sm_90.json").write_text(json.dumps(table))
    monkeypatch.setenv("KGEN_TABLES_DIR", str(tmp_path))
    # A copy of the module in a folder of its own: check's private import of it is not the one
    # other tests in this process use.
    generated = tmp_path / "generated"
    generated.mkdir()
    name = f"verify_{LAYOUT}__kv_bf16__q_bf16.py"
    (generated / name).write_text((kgen.generated_dir() / name).read_text())
    info = check.find_modules(generated, layouts=[LAYOUT], kv_dtypes=["bf16"], q_dtypes=["bf16"],
                              variants=["grouped"])[0]
    module = check.load_module_file(info.path)
    assert module.select_config("sm_90", GROUP, 4)["block_n"] == 16
    assert {2, 3, 5, 6} <= set(check.domain_batches(module, "sm_90"))  # the new row's boundaries
