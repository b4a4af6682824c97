"""kgen check's ledger: --update-ledger writes one sorted line a program, --ci compiles what the
ledger lacks and a seeded sample of what it holds, fails on a line the sample contradicts, judges
every program against its target and stops within its budget. The ledger logic runs on a
thread pool with a planted compile; one test compiles a handful of programs for real."""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kgen import check, check_ledger, cli

# Two dozen programs or so a target (the shipped tables' rows decide how many): enumerated in a second or
# two. fp16 KV with bf16 queries: Triton programs only under every Triton (no Gluon stage there). Tests that
# need every program sampled pass a minimum of at least the scope's count, never rely on that count.
SCOPE = ["--layout", "gqa64", "--kv-dtype", "fp16", "--q-dtype", "bf16", "--variant", "grouped", "--entry",
         "token-slot", "--index-dtype", "int32", "--largest-rows"]


def _job_id(job: dict) -> str:
    return json.dumps({k: job[k] for k in ("arch", "kernel", "constexprs", "options", "signature", "divisible")},
                      sort_keys=True)


class PlantedCompile:
    """compile_isolated's stand-in: fixed numbers a backend, ``planted`` ones for some programs."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.calls, self.planted = seconds, [], {}
        self.lock = threading.Lock()

    def plant(self, variant: check.Variant, **numbers) -> None:
        self.planted[_job_id(check._job(variant))] = numbers

    def __call__(self, job: dict) -> dict:
        with self.lock:
            self.calls.append(job)
        time.sleep(self.seconds)
        if job["arch"].startswith("gfx"):
            result = {"shared": 8192, "vgprs": 128, "sgprs": 40, "agprs": 0, "vgpr_spills": 0, "sgpr_spills": 0,
                      "scratch_bytes": 0, "mma": {"v_mfma_f32_16x16x16_bf16": 8}}
        else:
            result = {"shared": 16384 + len(job["options"]), "registers": 96, "stack_bytes": 0, "spill_stores": 0,
                      "spill_loads": 0, "mma": {"wgmma.mma_async bf16": 4}}
        return {**result, **self.planted.get(_job_id(job), {}), "error": None, "compile_s": self.seconds}


@pytest.fixture()
def planted(monkeypatch, tmp_path):
    monkeypatch.setenv("KGEN_CHECK_CACHE", str(tmp_path / "cache"))
    fake = PlantedCompile()
    monkeypatch.setattr(check, "compile_isolated", fake)
    monkeypatch.setattr(check, "_start_pool", lambda jobs: ThreadPoolExecutor(jobs))
    return fake


def _check(*args: str, archs: str = "sm_90") -> int:
    return cli.main(["check", "--arch", archs, *SCOPE, "--jobs", "2", "-q", *args])


def _programs(archs: tuple[str, ...] = ("sm_90",)) -> list[check.Variant]:
    return check_ledger.Scope(archs, {"layouts": ["gqa64"], "kv_dtypes": ["fp16"], "q_dtypes": ["bf16"],
                                      "variants": ["grouped"], "entries": ["token-slot"],
                                      "index_dtypes": ["int32"]}, True).programs.variants


def _rewrite(path, which: str, **changes) -> None:
    rows = path.read_text().splitlines()
    rows = [json.dumps({**json.loads(r), **changes}) if json.loads(r).get("key") == which else r for r in rows]
    path.write_text("\n".join(rows) + "\n")


def _drop(path, key: str) -> None:
    path.write_text("".join(r + "\n" for r in path.read_text().splitlines() if json.loads(r).get("key") != key))


def test_update_writes_one_sorted_line_a_program_and_a_rerun_changes_nothing(planted, tmp_path, capsys):
    ledger = tmp_path / "ledger.jsonl"
    assert _check("--update-ledger", "--ledger", str(ledger), archs="sm_90,gfx950") == 0
    programs = _programs(("sm_90", "gfx950"))
    header, *rows = [json.loads(r) for r in ledger.read_text().splitlines()]
    assert header["scope"] == ("--arch sm_90,gfx950 --layout gqa64 --kv-dtype float16 --q-dtype bfloat16 --variant "
                               "grouped --entry token-slot --index-dtype int32 --largest-rows")
    assert sorted(r["key"] for r in rows) == sorted(v.key for v in programs) and len(planted.calls) == len(programs)
    assert [r["target"] for r in rows] == sorted((r["target"] for r in rows), key=list(check.ARCHS).index)
    sm90 = next(r for r in rows if r["target"] == "sm_90")
    assert list(sm90) == ["target", "kernel", "modules", "program", "verdict", "shared", "registers", "spill_stores",
                          "spill_loads", "stack_bytes", "mma", "key"]
    assert sm90["verdict"] == "ok" and "num_warps=" in sm90["program"]
    assert {"vgprs", "vgpr_spills", "scratch_bytes"} <= set(next(r for r in rows if r["target"] == "gfx950"))
    text = ledger.read_text()
    assert _check("--update-ledger", "--ledger", str(ledger), archs="sm_90,gfx950") == 0
    assert ledger.read_text() == text and len(planted.calls) == len(programs)  # nothing compiled again
    assert "0 programs new" in capsys.readouterr().out


def test_a_current_ledger_compiles_nothing_new_and_samples_each_target(planted, tmp_path, capsys):
    ledger = tmp_path / "ledger.jsonl"
    _check("--update-ledger", "--ledger", str(ledger), archs="sm_90,gfx950")
    planted.calls.clear()
    assert _check("--ci", "--ledger", str(ledger), "--sample-min", "3", "--seed", "a", archs="sm_90,gfx950") == 0
    out = capsys.readouterr().out
    count = len(_programs(("sm_90", "gfx950")))
    assert out.splitlines()[-1] == f"ledger: {count} programs, 0 compiled new, 6 sampled, 0 differ"
    assert f"total {count} distinct programs" in out  # the scope counted first, as --count does
    assert sorted(c["arch"] for c in planted.calls) == ["gfx950"] * 3 + ["sm_90"] * 3


def test_the_sample_is_seeded_per_target_and_at_least_its_share(tmp_path):
    programs = _programs(("sm_90", "gfx950"))
    ledger = check_ledger.Ledger(tmp_path / "l.jsonl", None, {v.key: {} for v in programs[1:]})
    one = check_ledger.draw_sample(programs, ledger, "commit-a", fraction=0.3, minimum=2)
    assert one == check_ledger.draw_sample(programs, ledger, "commit-a", fraction=0.3, minimum=2)
    assert {v.key for v in one} != {v.key for v in check_ledger.draw_sample(programs, ledger, "commit-b", 0.3, 2)}
    for arch in ("sm_90", "gfx950"):
        mine = [v for v in programs if v.arch == arch]
        assert sum(v.arch == arch for v in one) == math.ceil(0.3 * len(mine))
    assert programs[0] not in one  # only programs the ledger holds are sampled
    # A minimum of at least a target's programs samples them all.
    assert len(check_ledger.draw_sample(programs, ledger, "x", minimum=len(programs))) == len(programs) - 1


def test_a_ledger_line_with_wrong_registers_fails_when_sampled(planted, tmp_path, capsys):
    ledger = tmp_path / "ledger.jsonl"
    _check("--update-ledger", "--ledger", str(ledger))
    key = _programs()[0].key
    _rewrite(ledger, key, registers=40)
    capsys.readouterr()
    every = ("--sample-min", str(len(_programs())))  # a minimum of every program samples them all
    assert _check("--ci", "--ledger", str(ledger), *every) == 1
    captured = capsys.readouterr()
    assert f"[{key}]: registers 40 in the ledger, 96 compiled" in captured.err
    assert f"--recompile {key}" in captured.err
    count = len(_programs())
    assert captured.out.splitlines()[-1] == f"ledger: {count} programs, 0 compiled new, {count} sampled, 1 differ"
    assert _check("--update-ledger", "--ledger", str(ledger), "--recompile", "beef") == 2  # not a key of the scope
    # The mend the message names.
    assert _check("--update-ledger", "--ledger", str(ledger), "--recompile", key) == 0
    assert _check("--ci", "--ledger", str(ledger), *every) == 0


def test_a_wrong_line_outside_the_sample_is_not_caught_but_a_wrong_verdict_is(planted, tmp_path, capsys):
    """What a sample does not prove: an unsampled line's numbers are trusted. Its verdict is
    judged again from them, so a line that says ok over a limit still fails."""
    ledger = tmp_path / "ledger.jsonl"
    _check("--update-ledger", "--ledger", str(ledger))
    args = ("--ci", "--ledger", str(ledger), "--sample-min", "1", "--seed", "s")
    sampled = {v.key for v in check_ledger.draw_sample(_programs(), check_ledger.Ledger.read(ledger), "s", 0, 1)}
    other = next(v.key for v in _programs() if v.key not in sampled)
    _rewrite(ledger, other, registers=40)
    assert _check(*args) == 0
    _rewrite(ledger, other, shared=300000)
    capsys.readouterr()
    assert _check(*args) == 1
    err = capsys.readouterr().err
    assert "shared memory 300000 B > 232448 B limit" in err and f"program {other}" in err
    assert f"[{other}]: verdict 'ok' in the ledger, 'shared memory 300000 B" in err


def test_a_program_missing_from_the_ledger_is_compiled_and_judged(planted, tmp_path, capsys):
    ledger = tmp_path / "ledger.jsonl"
    _check("--update-ledger", "--ledger", str(ledger))
    missing = _programs()[-1]
    _drop(ledger, missing.key)
    planted.calls.clear()
    planted.plant(missing, shared=240000)
    capsys.readouterr()
    assert _check("--ci", "--ledger", str(ledger), "--sample-min", "2", "--no-cache") == 1
    captured = capsys.readouterr()
    assert _job_id(check._job(missing)) in {_job_id(c) for c in planted.calls}
    assert "shared memory 240000 B > 232448 B limit" in captured.err and f"program {missing.key}" in captured.err
    assert captured.out.splitlines()[-1] == f"ledger: {len(_programs())} programs, 1 compiled new, 2 sampled, 0 differ"
    assert len(planted.calls) == 3


def test_a_stale_line_is_reported_and_dropped_by_an_update(planted, tmp_path, capsys):
    ledger = tmp_path / "ledger.jsonl"
    _check("--update-ledger", "--ledger", str(ledger))
    key = _programs()[0].key
    _rewrite(ledger, key, key="0" * 32)  # a program of a kernel that changed since
    assert _check("--ci", "--ledger", str(ledger)) == 0
    out = capsys.readouterr().out
    assert "1 ledger line(s) are no program of this scope" in out and "1 compiled new" in out
    assert _check("--update-ledger", "--ledger", str(ledger)) == 0
    assert "0" * 32 not in ledger.read_text() and key in ledger.read_text()


def test_too_many_missing_programs_fail_fast_naming_the_update(planted, tmp_path, capsys):
    planted.seconds = 0.25
    ledger = tmp_path / "ledger.jsonl"
    started = time.perf_counter()
    assert _check("--ci", "--ledger", str(ledger), "--budget-s", "1", "--jobs", "1") == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - started < 30
    assert len(planted.calls) < len(_programs())  # it stopped at the probe, before compiling everything
    assert f"{len(_programs())} programs of this scope are missing from the ledger" in err
    assert "over the budget of 1 s" in err
    assert "s a program (wall, measured on the first 4 compiled in this run)" in err
    assert "Run `kgen check --update-ledger --arch sm_90 --layout gqa64" in err and "commit the ledger" in err


def test_the_budget_is_a_hard_cap_after_the_probe():
    budget = check.Budget(10, str, probe_programs=2)
    budget.check(done=2, left=3, elapsed=2.0, probe_left=0)  # 1 s a program: 5 s projected
    assert budget.per_program == 1.0
    budget.check(done=4, left=1, elapsed=9.0, probe_left=0)
    with pytest.raises(check.BudgetExceeded, match="passed the budget of 10 s with 1 of 5 programs left"):
        budget.check(done=4, left=1, elapsed=10.5, probe_left=0)
    with pytest.raises(check.BudgetExceeded, match="50 programs to compile at 1.00 s"):
        check.Budget(10, str, probe_programs=2).check(done=2, left=48, elapsed=2.0, probe_left=0)


def test_ledger_errors_say_how_to_mend(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text('{"kgen check ledger": 1, "triton": "0.0"}\n')
    with pytest.raises(check.CheckError, match="not the header of a format-1 ledger of Triton"):
        check_ledger.Ledger.read(path)
    import triton

    path.write_text(json.dumps({"kgen check ledger": 1, "triton": triton.__version__}) + "\n{not json\n")
    with pytest.raises(check.CheckError, match="l.jsonl:2: not a JSON object"):
        check_ledger.Ledger.read(path)
    assert cli.main(["check", "--seed", "x"]) == 2  # a --ci option without --ci


def test_a_real_ledger_agrees_with_a_fresh_compile(tmp_path, monkeypatch, capsys):
    """Five programs compiled for sm_80 by --update-ledger, then all of them again by --ci."""
    monkeypatch.setenv("KGEN_CHECK_CACHE", str(tmp_path / "cache"))
    ledger = tmp_path / "ledger.jsonl"
    scope = ["check", "--arch", "sm_80", "--layout", "gqa64", "--kv-dtype", "bf16", "--q-dtype", "bf16", "--variant",
             "per_head", "--entry", "token-slot", "--index-dtype", "int32", "--largest-rows", "--jobs", "2", "-q",
             "--ledger", str(ledger)]
    assert cli.main([*scope, "--update-ledger"]) == 0
    rows = [json.loads(r) for r in ledger.read_text().splitlines()[1:]]
    assert len(rows) == 5 and all(r["verdict"] == "ok" and r["registers"] > 0 for r in rows)
    assert any(r["mma"] for r in rows)  # the prefix stage's mma.sync
    capsys.readouterr()
    assert cli.main([*scope, "--ci"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ledger: 5 programs, 0 compiled new, 5 sampled, 0 differ"


def test_the_seed_is_the_commit_and_outside_git_the_ledgers_content(tmp_path):
    import subprocess

    inside = check_ledger.Ledger(check_ledger.default_path(), None, {})
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=check_ledger.default_path().parents[1]).stdout.strip()
    assert check_ledger.commit_seed(inside) == head
    outside = tmp_path / "l.jsonl"
    outside.write_text("x\n")
    seed = check_ledger.commit_seed(check_ledger.Ledger(outside, None, {}))
    assert seed.startswith("ledger ") and seed == check_ledger.commit_seed(check_ledger.Ledger(outside, None, {}))
    outside.write_text("y\n")
    assert check_ledger.commit_seed(check_ledger.Ledger(outside, None, {})) != seed
