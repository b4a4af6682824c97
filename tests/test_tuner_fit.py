"""kgen tune's fit check (kgen/tuner/fit.py): a winner's row judged over its whole domain by
kgen check's rule before it is written. One test compiles for sm_90 for real (offline, on the
CPU), the others plant the judge."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from test_tuner_cli import parse

import kgen.tuner.fit as fit
from kgen.blockconfig import BlockConfig, read_table
from kgen.tuner.cli import run_tune

# GQA 64 g4 BF16 at batch 33-96 as a 60-trial study chose it on the H200 (4430f47): its L 4
# programs are fine, its programs for drafts 17-64 (128 rows, 128-token tiles on 2 warps) spill.
SPILLING = {"block_h": 4, "block_n": 128, "num_warps": 2, "num_stages": 3, "lazy_rescale": True,
            "draft_tile": "first", "split": {"programs_per_sm": 2, "max_splits": 128, "min_tokens_per_split": 512}}
FITTING = {"block_h": 4, "block_n": 64, "num_warps": 4, "num_stages": 3,
           "split": {"programs_per_sm": 2, "max_splits": 64, "min_tokens_per_split": 128}}
NARROW = {"q_dtypes": ["bfloat16"], "variants": ["grouped"], "entries": ["token-slot"], "index_dtypes": ["int64"]}


def _job() -> SimpleNamespace:
    return SimpleNamespace(arch="sm_90", layout=SimpleNamespace(name="gqa64"), kv_dtype="bfloat16", group_size=4,
                           bucket=SimpleNamespace(batch_min=33, batch_max=96))


def test_a_row_whose_long_drafts_spill_is_refused_and_one_that_fits_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("KGEN_CHECK_CACHE", str(tmp_path / "cache"))
    reason = fit.fit_error(_job(), BlockConfig.model_validate(SPILLING), narrowing=NARROW)
    assert reason is not None and reason.startswith("kgen check: _verify_prefix_stage at draft 17-64")
    assert "spills" in reason and "> 2048 B" in reason
    assert fit.fit_error(_job(), BlockConfig.model_validate(FITTING), narrowing=NARROW) is None


def test_the_candidate_table_holds_the_row_alone():
    table = fit.candidate_table(_job(), BlockConfig.model_validate(FITTING))
    (entry,) = table.entries
    assert (table.arch, entry.layout, entry.kv_dtype, entry.group_size) == ("sm_90", "gqa64", "bfloat16", 4)
    assert (entry.batch_min, entry.batch_max, entry.config) == (33, 96, BlockConfig.model_validate(FITTING))


def test_a_check_that_cannot_run_refuses():
    reason = fit.fit_error(SimpleNamespace(**{**vars(_job()), "layout": SimpleNamespace(name="no_such_layout")}),
                           BlockConfig.model_validate(FITTING))
    assert reason is not None and reason.startswith("the fit check could not run (exit 1")


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_the_tuner_writes_no_refused_winner(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch,
                                            mode: str) -> None:
    """--fit-check on: the synthetic study's first winner is refused, so the row written is
    another finalist's or the default's, and the refusal prints. auto with the synthetic
    objective: no judge runs."""
    judged: list[BlockConfig] = []

    def judge(job, config, **_):
        judged.append(config)
        return "kgen check: planted" if len(judged) == 1 else None

    monkeypatch.setattr(fit, "fit_error", judge)
    args = ["--objective", "synthetic", "--arch", "sm_90", "--layout", "gqa64", "--group", "8", "--kv-dtype",
            "bf16", "--storage", f"sqlite:///{tmp_path / 'tune.db'}", "--out", str(tmp_path), "--no-progress",
            "--trials", "25", "--bucket", "b2-8", "--fit-check", mode]
    assert run_tune(parse(*args)) == 0
    (row,) = [e for e in read_table(tmp_path / "sm_90.json").entries
              if (e.layout, e.group_size, e.batch_min) == ("gqa64", 8, 1)]
    out = capsys.readouterr().out
    if mode == "auto":
        assert judged == []
        return
    assert judged and row.config != judged[0]
    assert f"{judged[0].short()} refused: kgen check: planted" in out
