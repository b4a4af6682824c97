"""`kgen tune` on the command line: the hook for the main CLI, dry runs, errors, a
synthetic end-to-end run that writes a table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kgen.blockconfig import TABLE_DIR, TableEntry, TableFile, read_table
from kgen.errors import KgenError
from kgen.tuner.cli import SYNTHETIC_NOTE, add_tune_parser, main, run_tune

ROOT = Path(__file__).resolve().parents[1]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kgen")
    add_tune_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["tune", *argv])


def test_the_main_cli_hooks_in_through_add_tune_parser() -> None:
    args = parse("--arch", "sm_90", "--dry-run", "--layout", "gqa64", "--group", "8", "--trials", "7")
    assert args.func is run_tune
    assert (args.arch, args.trials, args.workers, args.layout, args.group) == ("sm_90", 7, 1, ["gqa64"], [8])


def test_dry_run_prints_space_and_workloads_without_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from kgen.tuner.cli import main; "
        "rc = main(['tune', '--dry-run', '--arch', 'gfx942', '--layout', 'qwen3_5_gqa256', '--group', '4']); "
        "assert 'torch' not in sys.modules, 'a dry run imported torch'; sys.exit(rc)"
    )
    env = {**os.environ, "KGEN_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"sqlite:///{tmp_path}/tune.db" in text
    assert "kgen/tables/gfx942.json" in text
    assert "float8_e4m3fnuz" in text and "float8_e4m3fn " not in text  # gfx942's fp8 flavour
    assert "matrix_instr_nonkdim" in text and "65536" in text
    assert "bs256/P16384/L4" in text and "10 studies, 100 finished trials each" in text  # 2 KV dtypes x 5 buckets
    assert not list(tmp_path.iterdir()), "a dry run wrote nothing"


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--dry-run"], "--arch is required"),
        (["--dry-run", "--arch", "tpu_v5"], "unknown arch"),
        (["--dry-run", "--arch", "sm_90", "--layout", "llama"], r"unknown layout.*gqa128"),
        (["--dry-run", "--arch", "sm_90", "--bucket", "huge"], r"unknown bucket 'huge'.*b2-8"),
        (["--dry-run", "--arch", "sm_90", "--kv-dtype", "int4"], "unknown KV dtype"),
        (["--dry-run", "--arch", "sm_90", "--layout", "gqa64", "--group", "2"], r"group size\(s\) \[2\]"),
        (["--dry-run", "--arch", "sm_90", "--trials", "0"], "--trials must be >= 1"),
        (["--dry-run", "--arch", "sm_90", "--draft-tokens", "0,4"], "draft lengths are 1 to 64"),
        (["--dry-run", "--arch", "sm_90", "--draft-tokens", "4,x"], "as integers"),
    ],
)
def test_bad_selections_are_errors_that_say_what_to_fix(argv: list[str], pattern: str) -> None:
    with pytest.raises(KgenError, match=pattern):
        run_tune(parse(*argv))


def test_standalone_main_prints_errors_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--dry-run", "--arch", "sm_90", "--bucket", "huge"]) == 2
    assert "kgen tune: error: unknown bucket" in capsys.readouterr().err


def test_draft_tokens_time_every_bucket_at_those_lengths_in_new_studies(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--dry-run", "--arch", "sm_90", "--layout", "gqa64", "--group", "8", "--bucket", "b33-96"]
    assert run_tune(parse(*common)) == 0
    plain = capsys.readouterr().out
    assert run_tune(parse(*common, "--draft-tokens", "4,16,4")) == 0
    both = capsys.readouterr().out
    assert "bs64/P16384/L16" in both and "bs64/P16384/L16" not in plain
    assert both.count("/L4") == plain.count("/L4") and both.count("/L16") == plain.count("/L4")
    study = [line for line in both.splitlines() if "study kgen-tune:" in line]
    assert study and study[0] not in plain  # the workloads' hash names another study


def test_synthetic_run_writes_and_merges_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sm_90.json"
    common = [
        "--objective",
        "synthetic",
        "--arch",
        "sm_90",
        "--layout",
        "gqa64",
        "--group",
        "4",
        "--kv-dtype",
        "bf16",
        "--storage",
        f"sqlite:///{tmp_path / 'tune.db'}",
        "--out",
        str(out.parent),
        "--no-progress",
        "--trials",
        "25",
    ]
    shipped = read_table(TABLE_DIR / "sm_90.json")

    def tuned(table: TableFile) -> list[TableEntry]:
        return [e for e in table.entries if (e.layout, e.kv_dtype, e.group_size) == ("gqa64", "bfloat16", 4)]

    def buckets(table: TableFile) -> list[tuple[int, int]]:
        return sorted((e.batch_min, e.batch_max) for e in tuned(table))

    shipped_buckets = buckets(shipped)
    assert not {(2, 8), (97, 1 << 30)} & set(shipped_buckets), "the test tunes buckets the shipped table lacks"
    assert run_tune(parse(*common, "--bucket", "b2-8")) == 0
    first = read_table(out)
    # A new file starts from the shipped table: its rows are kept beside the tuned one.
    assert buckets(first) == sorted([*shipped_buckets, (2, 8)])
    assert len(first.entries) == len(shipped.entries) + 1
    assert first.metadata.note == SYNTHETIC_NOTE and first.metadata.trials == shipped.metadata.trials + 25
    printed = capsys.readouterr().out
    assert "default us" in printed and f"wrote {out}" in printed
    assert run_tune(parse(*common, "--bucket", "b97+")) == 0
    second = read_table(out)
    assert buckets(second) == sorted([*shipped_buckets, (2, 8), (97, 1 << 30)])
    assert [e for e in tuned(second) if e.batch_min == 2] == [e for e in tuned(first) if e.batch_min == 2]
    assert json.loads(out.read_text())["schema"] == "kgen.block-config-table/1"


def test_a_tuned_row_keeps_the_defaults_widen_from_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GQA 128's built-in default widens its 128-row programs; no axis searches that, and the
    study's L 4 launches do not depend on it, so the row it writes keeps it and says so."""
    args = ["--objective", "synthetic", "--arch", "sm_90", "--layout", "gqa128", "--group", "8", "--kv-dtype",
            "bf16", "--storage", f"sqlite:///{tmp_path / 'tune.db'}", "--out", str(tmp_path), "--no-progress",
            "--trials", "12", "--bucket", "b2-8"]
    assert run_tune(parse(*args)) == 0
    (row,) = [e for e in read_table(tmp_path / "sm_90.json").entries
              if (e.layout, e.group_size, e.batch_min) == ("gqa128", 8, 1)]
    assert row.config.widen_from_rows == 128
    assert "widen_from_rows 128 kept from the config in use" in capsys.readouterr().out


def test_synthetic_run_without_out_writes_no_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--objective",
        "synthetic",
        "--arch",
        "gfx950",
        "--layout",
        "gqa64",
        "--kv-dtype",
        "bf16",
        "--bucket",
        "b2-8",
        "--storage",
        f"sqlite:///{tmp_path / 'tune.db'}",
        "--no-progress",
        "--trials",
        "5",
    ]
    assert run_tune(parse(*argv)) == 0
    assert "no table written" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tune.db"]


# ----------------------------------------------------------------- the storage URL's password

SECRET = "s3cr3t-Pw"
PG_URL = f"postgresql+psycopg2://kgen:{SECRET}@127.0.0.1:1/kgen"  # port 1: nothing listens
DRY = ["--dry-run", "--arch", "sm_90", "--layout", "gqa64", "--group", "8", "--bucket", "b2-8"]


def test_dry_run_shows_the_storage_without_its_password(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tune(parse(*DRY, "--storage", PG_URL)) == 0
    out = capsys.readouterr().out
    assert SECRET not in out
    assert "storage: postgresql+psycopg2://kgen:***@127.0.0.1:1/kgen  (from --storage)" in out


def test_storage_from_the_environment_and_the_flag_wins(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("KGEN_TUNE_STORAGE", PG_URL)
    assert run_tune(parse(*DRY)) == 0
    out = capsys.readouterr().out
    assert "kgen:***@127.0.0.1:1/kgen  (from $KGEN_TUNE_STORAGE)" in out and SECRET not in out
    flag = f"sqlite:///{tmp_path / 'flag.db'}"
    assert run_tune(parse(*DRY, "--storage", flag)) == 0
    assert f"storage: {flag}  (from --storage)" in capsys.readouterr().out
    monkeypatch.delenv("KGEN_TUNE_STORAGE")
    monkeypatch.setenv("KGEN_CACHE_DIR", str(tmp_path))
    assert run_tune(parse(*DRY)) == 0
    assert f"storage: sqlite:///{tmp_path}/tune.db  (from default)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "url",
    [
        PG_URL,  # unreachable server
        f"postgresql+psycopg2://kgen:{SECRET}@127.0.0.1:1/kgen?sslmode=bogus-mode",
        f"postgresql//kgen:{SECRET}@127.0.0.1:1/kgen",  # not a URL
        f"nosuchdialect://kgen:{SECRET}@127.0.0.1:1/kgen",  # no such driver
        "postgresql+psycopg2://kgen:s3cr@t-Pw@127.0.0.1:1/kgen",  # a raw '@' in the password
    ],
)
def test_storage_errors_do_not_show_the_password(url: str, tmp_path: Path) -> None:
    argv = ["--objective", "synthetic", "--arch", "sm_90", "--layout", "gqa64", "--kv-dtype", "bf16", "--group",
            "8", "--bucket", "b2-8", "--trials", "2", "--no-progress", "--storage", url]  # fmt: skip
    with pytest.raises(KgenError) as info:
        run_tune(parse(*argv))
    text = str(info.value)
    assert "storage" in text
    for piece in (SECRET, "s3cr@t-Pw", "s3cr", "t-Pw"):
        assert piece not in text, text


def test_redact_url_forms() -> None:
    from kgen.tuner.study import redact_url, scrub_secret

    assert redact_url("sqlite:////tmp/tune.db") == "sqlite:////tmp/tune.db"
    assert redact_url("postgresql://u@h/db") == "postgresql://u@h/db"
    assert redact_url("postgresql://u:p%40ss@h/db") == "postgresql://u:***@h/db"
    assert redact_url("postgresql://u:pa@ss@h/db") == "postgresql://u:***@h/db"
    assert redact_url("garbage u:pw@h") == "garbage u:***@h"
    assert scrub_secret("auth failed for p@ss at postgresql://u:p%40ss@h/db", "postgresql://u:p%40ss@h/db") == (
        "auth failed for *** at postgresql://u:***@h/db"
    )


def test_help_names_the_storage_variable() -> None:
    parser = argparse.ArgumentParser(prog="kgen")
    sub = parser.add_subparsers(dest="command")
    text = add_tune_parser(sub).format_help()
    assert "KGEN_TUNE_STORAGE" in text and "--report" in text
