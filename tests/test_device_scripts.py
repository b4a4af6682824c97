"""The device scripts of benchmarks/device/ on a CPU: their shell parses, their arguments are
checked before anything is installed, and what they would run on the GPU is the right thing
(the bench of record selects exactly its baselines' cases; a tune job becomes the studies it
names). The GPU work itself runs only on the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DEVICE = ROOT / "benchmarks" / "device"
SCRIPTS = ("gpu_tests.sh", "tune.sh", "bench_of_record.sh", "bench_flashinfer.sh", "ab_rows.sh")


def _run(args: list[str], tmp_path: Path, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    # No wheels: a checkout's .whl/ holds the GPU machine's (another Python's) wheels.
    full_env = {**os.environ, "OUT": str(tmp_path / "out"), "KGEN_CACHE_DIR": str(tmp_path / "cache"),
                "KGEN_WHEEL_DIR": str(tmp_path / "no-wheels"), "KGEN_FLASHINFER_AOT": str(tmp_path / "no-aot"), **env}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(["bash", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_parses_and_uses_the_shared_set_up(name: str) -> None:
    path = DEVICE / name
    text = path.read_text()
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.access(path, os.X_OK), f"{path} is not executable"
    header = text.split("\nset ", 1)[0]
    assert "Usage" in header and "OUT" in header and "Exit status" in header, f"{name}: undocumented header"
    assert "set -uo pipefail" in text and "kgen_device_setup" in text and 'source "$(dirname "$0")/env.sh"' in text
    assert "pip install" not in text, f"{name}: installing wheels belongs in env.sh alone"


def test_set_up_refuses_to_run_outside_the_repository_root(tmp_path: Path) -> None:
    proc = _run([str(DEVICE / "gpu_tests.sh")], tmp_path, cwd=tmp_path)
    assert proc.returncode == 2
    assert "repository root" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("job", ["qwen3_5_gqa256:bf16:8", "qwen3_5_gqa256:bf16:eight:b33-96", "a:b:8:b33-96,"])
def test_tune_refuses_a_malformed_job_before_the_set_up(tmp_path: Path, job: str) -> None:
    proc = _run([str(DEVICE / "tune.sh"), "qwen3_5_gqa256:bf16:16:b9-32", job], tmp_path)
    assert proc.returncode == 2
    assert f"'{job}' is not LAYOUT:KV:GROUP:BUCKET" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_tune_without_jobs_prints_usage(tmp_path: Path) -> None:
    proc = _run([str(DEVICE / "tune.sh")], tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("usage:")


def test_tune_dry_run_names_the_studies_of_each_job(tmp_path: Path) -> None:
    proc = _run([str(DEVICE / "tune.sh"), "qwen3_5_gqa256:bf16:8:b33-96,b97+", "mla_absorbed_512_64:fp8:16:b9-32"],
                tmp_path, TUNE_DRY_RUN="1", STUDY_S="30")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (tmp_path / "out" / "tune.log").read_text()
    for study in ("qwen3_5_gqa256:bfloat16:bfloat16:g8:b33-96", "qwen3_5_gqa256:bfloat16:bfloat16:g8:b97+",
                  "mla_absorbed_512_64:float8_e4m3fn:bfloat16:g16:b9-32"):  # fmt: skip
        assert f"kgen-tune:sm_90:{study}:" in log, study
    assert "g4:" not in log and "b2-8" not in log and ":b1:" not in log
    assert (tmp_path / "out" / "env.log").exists()


def test_tune_drafts_reach_kgen_tune(tmp_path: Path) -> None:
    proc = _run([str(DEVICE / "tune.sh"), "mla_absorbed_512_64:bf16:16:b33-96"], tmp_path, TUNE_DRY_RUN="1",
                TUNE_DRAFTS="4,16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (tmp_path / "out" / "tune.log").read_text()
    assert "bs64/P16384/L4" in log and "bs64/P16384/L16" in log


def test_bench_of_record_refuses_an_unknown_part(tmp_path: Path) -> None:
    proc = _run([str(DEVICE / "bench_of_record.sh"), "headlines"], tmp_path)
    assert proc.returncode == 2 and "unknown part 'headlines'" in proc.stderr


def test_bench_of_record_measures_exactly_the_cases_of_its_baselines(tmp_path: Path) -> None:
    """`--list` goes through the same two `kgen bench` calls the device runs; each must select
    the cases of the baseline it is compared with, or the comparison judges nothing."""
    proc = _run([str(DEVICE / "bench_of_record.sh"), "all", "--list"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed: dict[str, set[str]] = {}
    part = None
    for line in proc.stdout.splitlines():
        if line in ("== bench_of_record.sh: headline", "== bench_of_record.sh: matrix"):
            part = line.rsplit(" ", 1)[1]
            listed[part] = set()
        elif part and line.startswith("  ") and "/" in line:
            listed[part].add(line.split()[0])
    for part, baseline in (("headline", "h200.json"), ("matrix", "h200_matrix.json")):
        run = json.loads((ROOT / "benchmarks" / "baselines" / baseline).read_text())
        assert listed[part] == {case["key"] for case in run["cases"]}, part


def test_bench_flashinfer_refuses_an_unknown_part(tmp_path: Path) -> None:
    proc = _run([str(DEVICE / "bench_flashinfer.sh"), "gqa,trees,mla_g16"], tmp_path)
    assert proc.returncode == 2 and "unknown part 'mla_g16'" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_bench_flashinfer_measures_the_cases_of_record(tmp_path: Path) -> None:
    """`--list` through the script's `kgen bench` calls: each part selects its cases of record."""
    proc = _run([str(DEVICE / "bench_flashinfer.sh"), "gqa,mla,mla_g128,mla_small,trees,gqa128,gqa64,small",
                 "--list"], tmp_path, KGEN_BENCH_KV="bf16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed: dict[str, set[str]] = {}
    part = None
    for line in proc.stdout.splitlines():
        if line.startswith("== bench_flashinfer.sh: ") and " exit" not in line:
            part = line.rsplit(" ", 1)[1]
            listed[part] = set()
        elif part and line.startswith("  ") and "/" in line:
            listed[part].add(line.split()[0])
    gqa = {f"qwen3_5_gqa256/g{g}/bf16/bs64/p16384/L{n}" for g in (16, 4) for n in (4, 8, 16)}
    assert listed["gqa"] == gqa
    assert listed["mla"] == {f"mla_absorbed_512_64/g16/bf16/bs64/p16384/L{n}" for n in (4, 8, 16)}
    assert listed["mla_g128"] == {"mla_absorbed_512_64/g128/bf16/bs16/p4096/L4"}
    assert listed["mla_small"] == {"mla_absorbed_512_64/g16/bf16/bs16/p1024/L4"}
    assert listed["trees"] == {f"qwen3_5_gqa256/g16/bf16/bs64/p16384/L{n}/mask-tree" for n in (8, 16, 64)}
    assert listed["gqa128"] == {f"gqa128/g{g}/bf16/bs64/p16384/L{n}" for g in (8, 16) for n in (4, 8, 16)}
    assert listed["gqa64"] == {f"gqa64/g8/bf16/bs64/p16384/L{n}" for n in (4, 8, 16)}
    assert listed["small"] == {f"{layout}/g16/bf16/bs{b}/p{p}/L4" for b in (1, 16, 64) for p in (1024, 16384)
                               for layout in ("qwen3_5_gqa256", "mla_absorbed_512_64")}
    every = _run([str(DEVICE / "bench_flashinfer.sh"), "all", "--list"], tmp_path, KGEN_BENCH_KV="bf16")
    parts = [line.rsplit(" ", 1)[1] for line in every.stdout.splitlines()
             if line.startswith("== bench_flashinfer.sh: ") and " exit" not in line]
    assert every.returncode == 0 and parts == [p for p in listed if p != "small"]


def test_bench_flashinfer_small_is_bf16_unless_told(tmp_path: Path) -> None:
    """The part small (issue 35's BF16 record) lists BF16 cases alone by default; the other parts keep
    BF16 and FP8; KGEN_BENCH_KV still rules where it is set."""

    def kv_tags(part: str, **env: str) -> set[str]:
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv("KGEN_BENCH_KV", raising=False)
            proc = _run([str(DEVICE / "bench_flashinfer.sh"), part, "--list"], tmp_path, **env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        cases = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ") and "/" in line]
        return {case.split("/")[2] for case in cases}

    assert kv_tags("small") == {"bf16"}
    assert kv_tags("mla_small") == {"bf16", "fp8_e4m3fn"}
    assert kv_tags("small", KGEN_BENCH_KV="fp8") == {"fp8_e4m3fn"}


def test_env_copies_flashinfers_prebuilt_kernels_next_to_the_installed_package(tmp_path: Path) -> None:
    """kgen_flashinfer_aot SITE: .fi-aot/ lands in SITE/flashinfer/data/aot/ where a flashinfer wheel
    was installed there, and is left alone (with a word) where none was."""
    aot = tmp_path / "aot" / "quantization"
    aot.mkdir(parents=True)
    (aot / "quantization.so").write_bytes(b"so")
    site = tmp_path / "site"
    script = f'source {DEVICE / "env.sh"} && KGEN_FLASHINFER_AOT={tmp_path / "aot"} kgen_flashinfer_aot {site}'
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "no flashinfer wheel" in proc.stderr and not site.exists()
    (site / "flashinfer").mkdir(parents=True)
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (site / "flashinfer" / "data" / "aot" / "quantization" / "quantization.so").read_bytes() == b"so"


def _variant(tmp_path: Path, name: str, *edits: str) -> Path:
    out = tmp_path / name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("KGEN_TABLES_DIR", None)
    env.pop("KGEN_TABLE", None)
    tool = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "table_variant.py"), "--out", str(out),
                           "--row", *edits], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert tool.returncode == 0, tool.stderr
    return out


def test_ab_rows_refuses_a_folder_without_a_table_or_no_bench_arguments(tmp_path: Path) -> None:
    proc = _run([str(DEVICE / "ab_rows.sh"), str(tmp_path), "--", "--layout", "gqa64:8"], tmp_path)
    assert proc.returncode == 2 and "holds no table" in proc.stderr
    variant = _variant(tmp_path, "v", "gqa64:bf16:8:33-96", "split.max_splits=1")
    proc = _run([str(DEVICE / "ab_rows.sh"), str(variant)], tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("usage:")
    twin = _variant(tmp_path / "other", "v", "gqa64:bf16:8:33-96", "num_warps=4")
    proc = _run([str(DEVICE / "ab_rows.sh"), str(variant), str(twin), "--", "--layout", "gqa64:8"], tmp_path)
    assert proc.returncode == 2 and "share the name v" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_ab_rows_times_each_variant_against_the_shipped_rows_on_the_cases_asked(tmp_path: Path) -> None:
    """A dry run prints each variant's heading (the edits its table records) and the kgen bench
    command with its table, against the shipped rows, on the cases the arguments select."""
    first = _variant(tmp_path, "s1", "gqa64:bf16:8:33-96", "split.max_splits=1")
    second = _variant(tmp_path, "w4", "gqa64:bf16:8:33-96", "num_warps=4")
    proc = _run([str(DEVICE / "ab_rows.sh"), str(first), str(second), "--", "--layout", "gqa64:8", "--kv-dtype", "bf16",
                 "--batch", "64", "--prefix", "4K,16K", "--draft", "4"], tmp_path, AB_DRY_RUN="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for variant, edit in ((first, "split.max_splits=1"), (second, "num_warps=4")):
        heading = f"== ab_rows.sh: {variant.name}: variant of the shipped sm_90 table: gqa64:bf16:8:33-96 {edit}"
        assert heading in proc.stdout
        assert f"KGEN_TABLES_DIR={variant} python3 -m kgen.cli bench --kernels grouped" in proc.stdout
    assert proc.stdout.count("--baseline-tables kgen/tables") == 2
    cases = {line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert cases == {"gqa64/g8/bf16/bs64/p4096/L4", "gqa64/g8/bf16/bs64/p16384/L4"}
