"""`kgen explain`'s one-line view: every decision on one line of at most 100 characters that
ends with its brief, a whole clause; at most 60 lines for every shipped layout, KV dtype and
the forms the README documents (--batch-invariant, --arch, --model, --group); nothing cut.
`--verbose` and `--pass` keep the whole reasons."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from kgen.blockconfig import BlockConfig, GluonConfig, SplitPolicy, batch_span, compact_notation
from kgen.explain import _ROW_OF_GROUP, PASS_WIDTH, WIDTH, _merged_groups, _relative, _row, _shown, explain
from kgen.passes.context import load_context
from kgen.passes.pipeline import PASSES, run_pipeline
from kgen.plan import BRIEF_WIDTH, Decision, Plan, new_plan
from kgen.spec import load_layouts
from kgen.targets import read_targets

SPECS = load_layouts()
TARGETS = list(read_targets())
MAX_LINES = 60
ROW_INDENT = PASS_WIDTH + 2  # where a row's what starts when its pass name is not repeated
# Words a clause does not end on: a line that ends on one was cut mid-sentence.
DANGLING = frozenset("a an the of to and or for with by in at from than as its their is are be but nor on into "
                     "per via which that whose when where while so if".split())


def whole_clause(text: str) -> bool:
    """Whether ``text`` reads as whole: no ellipsis, brackets and quotes closed, and it does not
    end on punctuation or a word that needs more after it."""
    text = text.rstrip()
    if not text or "…" in text or "..." in text or text.endswith((",", ";", ":", "(", "[", "—", "-", "/", "=")):
        return False
    last = re.search(r"([A-Za-z_]+)\W*$", text)
    if last and last.group(1).lower() in DANGLING and not text.endswith((")", "'", "`")):
        return False
    # Apostrophes (request's, splits' loads, the gate's 'gqa128''s) are not quotes.
    quotes = re.sub(r"(?<=\w)'(?=\w)|(?<=s)'(?= )", "", text.replace("''s", "'")).count("'")
    return (text.count("(") == text.count(")") and text.count("[") == text.count("]")
            and text.count("`") % 2 == 0 and quotes % 2 == 0)


def logical_lines(text: str) -> list[str]:
    """The output's lines with their continuations joined: a continuation is indented but not a
    row (the warning's lines, a brief or value moved under its row, a wrapped gate reason)."""
    joined: list[str] = []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        row = indent in (0, ROW_INDENT) or (indent > ROW_INDENT and " = " in line.split(" — ")[0])
        if joined and not row:
            joined[-1] += " " + line.strip()
        else:
            joined.append(line)
    return joined


def plans() -> Iterator[tuple[str, str, str, bool]]:
    """(layout, KV dtype, variant, batch invariant) for every module a shipped layout makes."""
    for name, spec in sorted(SPECS.items()):
        for kv in spec.dtypes.kv:
            yield name, kv, "grouped", False
            yield name, kv, "grouped", True
        yield name, "bfloat16", "per_head", False


def forms(layout: str) -> Iterator[dict]:
    """The command forms of one layout: every KV dtype, default and batch-invariant, without an
    arch and on every target; fp16 queries and the per-head variant; every model it lists, one
    no layout lists; every listed group, one unlisted; a tree."""
    spec = SPECS[layout]
    for kv in spec.dtypes.kv:
        for invariant in (False, True):
            yield {"kv_dtype": kv, "batch_invariant": invariant}
            for arch in TARGETS:
                yield {"kv_dtype": kv, "batch_invariant": invariant, "arch": arch}
    yield {"q_dtype": "float16"}
    yield {"variant": "per_head", "arch": "sm_90"}
    for model in (*spec.architectures, "MistralForCausalLM"):
        yield {"model": model, "arch": "sm_90"}
    for group in (*spec.attention.group_sizes, 3):
        yield {"group": group, "arch": "sm_90"}
    yield {"topk": 4, "arch": "gfx950"}


@pytest.mark.parametrize("layout", sorted(SPECS))
def test_every_form_fits_sixty_lines_of_a_hundred_characters_with_nothing_cut(layout):
    for form in forms(layout):
        text = explain(layout, **form)
        lines = text.splitlines()
        assert len(lines) <= MAX_LINES, (form, len(lines))
        for line in lines:
            assert len(line) <= WIDTH, (form, line)
        for line in logical_lines(text)[1:]:  # the first is the command
            assert whole_clause(line), (form, line)
            if " — " in line:
                assert whole_clause(line.rsplit(" — ", 1)[1]), (form, line)


def _plan(layout: str, kv: str, variant: str, invariant: bool) -> Plan:
    return run_pipeline(new_plan(SPECS[layout], kv, "bfloat16", variant, invariant), load_context(check_only=True))


@pytest.mark.parametrize(("layout", "kv", "variant", "invariant"), list(plans()))
def test_each_decision_is_one_line_ending_with_its_whole_brief(layout, kv, variant, invariant):
    """Every decision but the fit pass's cells has a brief of its own, a whole clause of at most
    BRIEF_WIDTH characters, shown whole on one line after its what and its value; the cells
    are counted in their target's summary."""
    plan = _plan(layout, kv, variant, invariant)
    lines = explain(layout, kv, variant=variant, batch_invariant=invariant).splitlines()
    for d in plan.decisions:
        if d.detail:
            assert not any(f" {d.what} = {d.value}" in line for line in lines), d
            continue
        brief = _relative(d.brief)
        assert len(brief) <= BRIEF_WIDTH and whole_clause(brief), d
        assert d.brief == d.why or len(d.brief) < len(d.why), d  # a brief is the short form
        value = _shown(d.value, splits=not invariant)
        what = re.escape(d.what)
        if row := _ROW_OF_GROUP.fullmatch(d.what):
            # Rows that differ in their group alone share a line ('sm_90 groups 4, 8 batch 1+').
            arch, group, batches = (re.escape(row[part]) for part in ("arch", "group", "batches"))
            what = rf"(?:{what}|{arch} groups (?:\d+, )*{group}(?:, \d+)* batch {batches})"
        # Its line: the value after the what, or alone on the next line where it is too wide for it.
        at = next(i for i, line in enumerate(lines) if re.search(rf"\s{what} += {re.escape(value)}", line)
                  or re.search(rf"\s{what} +=$", line) and lines[i + 1].strip() == value)
        if lines[at].endswith("="):
            at += 1
        assert lines[at].endswith(f" — {brief}") or lines[at + 1].strip() == f"— {brief}", (d, lines[at])
    starts = [line.split()[0] for line in lines if line[:1].isalpha()]
    assert [fn.__name__ for fn in PASSES] == [s for s in starts if s in {fn.__name__ for fn in PASSES}]


@pytest.mark.parametrize(("layout", "kv", "variant", "invariant"), list(plans()))
def test_verbose_and_one_pass_keep_the_whole_reasons(layout, kv, variant, invariant):
    plan = _plan(layout, kv, variant, invariant)
    verbose = " ".join(explain(layout, kv, variant=variant, batch_invariant=invariant, verbose=True).split())
    for d in plan.decisions:
        assert " ".join(d.why.split()) in verbose, d
    fit = " ".join(explain(layout, kv, variant=variant, batch_invariant=invariant, only_pass="fit").split())
    for d in plan.decisions_of("fit"):  # the cells too, with their whole reasons
        assert f"{d.what} = {d.value}" in fit and " ".join(d.why.split()) in fit, d
    assert any(len(d.why) > BRIEF_WIDTH for d in plan.decisions)  # so the two views differ


def test_a_row_too_wide_moves_its_brief_and_never_cuts():
    fits = _row("emit", "file", 4, "generated/x.py", "up to date")
    assert fits == [f"{'emit':<{PASS_WIDTH}}  file = generated/x.py — up to date"]
    value = "H16 N32 w8 s3 2/64/128 gluon(N64 s2 1/64/256) lazy_rescale"  # leaves no room for the brief
    moved = _row("select_config", "default config", 14, value, "rule for K <= 1024")
    assert len(moved) == 2 and all(len(line) <= WIDTH for line in moved)
    assert moved[0].endswith(f"default config = {value}") and moved[1] == " " * 34 + "— rule for K <= 1024"
    wide = value + " draft_tile=first invariant H8"  # wider than its line: continued under itself
    continued = _row("select_config", "default config", 14, wide, "rule for K <= 1024")
    assert all(len(line) <= WIDTH for line in continued) and continued[1].startswith(" " * 34 + "draft_tile")
    assert " ".join(" ".join(continued).split()).endswith(f"{wide} — rule for K <= 1024")
    name = "generated/" + "x" * 80 + ".py"  # one word wider than what follows the "="
    alone = _row("emit", "file", 4, name, "up to date")
    assert alone[0].rstrip().endswith("file =") and alone[1].strip() == name and alone[2].strip() == "— up to date"
    words = " ".join(f"word{i}" for i in range(40))
    wrapped = _row("gate", "decision", 8, "general", words)
    assert all(len(line) <= WIDTH for line in wrapped) and " ".join(" ".join(wrapped).split()).endswith(words)


def test_a_decision_without_a_brief_briefs_its_why():
    assert Decision("p", "what", 1, "short reason").brief == "short reason"
    assert Decision("p", "what", 1, "a long reason; with more", "short").brief == "short"


def test_the_compact_config_names_every_knob_it_holds():
    config = BlockConfig(block_h=16, block_n=32, num_warps=8, num_stages=3, lazy_rescale=True, draft_tile="first",
                         split=SplitPolicy(programs_per_sm=2, max_splits=64, min_tokens_per_split=128),
                         gluon=GluonConfig(block_n=64, num_stages=2, lazy_rescale=True), invariant_block_h=8)
    assert config.compact() == ("H16 N32 w8 s3 2/64/128 lazy_rescale draft_tile=first "
                                "gluon(N64 s2 lazy_rescale 1/64/256) invariant H8")
    assert config.compact(splits=False) == "H16 N32 w8 s3 lazy_rescale draft_tile=first gluon(N64 s2 lazy_rescale) " \
                                           "invariant H8"
    rocm = BlockConfig(block_h=8, block_n=64, num_warps=4, num_stages=2, waves_per_eu=2, matrix_instr_nonkdim=16,
                       kpack=2)
    assert rocm.compact().endswith("waves_per_eu=2 nonkdim=16 kpack=2")
    assert compact_notation() == "H BLOCK_H, N BLOCK_N, w warps, s stages, ppsm/max/min_tok"
    assert "ppsm" not in compact_notation(splits=False)
    assert (batch_span(9, 32), batch_span(97, 1 << 30), batch_span(4, 4)) == ("9-32", "97+", "4")


def test_the_fit_summary_counts_its_cells():
    """gqa128's sm_89 programs shed stages and 64-token tiles for shared memory: its summary
    says how far, from the cells it counts (each a detail)."""
    plan = _plan("gqa128", "bfloat16", "grouped", False)
    decided = plan.decisions_of("fit")
    (summary,) = [d for d in decided if d.what == "sm_89"]
    cells = [d for d in decided if d.what.startswith("sm_89 group")]
    assert cells and all(d.detail for d in cells) and not summary.detail
    assert summary.value == "stages to 1, BLOCK_N to 32" and summary.brief == "for shared memory"
    assert "num_stages 2 -> 1" in " ".join(d.why for d in cells) and "BLOCK_N 64 -> 32" in " ".join(
        d.why for d in cells)
    # On sm_90 the head dim 128 default's 128-row programs take 8 warps (its widen_from_rows).
    (wide,) = [d for d in decided if d.what == "sm_90"]
    assert wide.value == "warps to 8" and wide.brief == "for registers"


def test_rows_that_differ_in_their_group_alone_share_a_line():
    rows = [("sm_90 row group 4 batch 1+", "Triton at every L", "it fits"),
            ("sm_90 row group 8 batch 1+", "Triton at every L", "it fits"),
            ("sm_90 row group 16 batch 1+", "Gluon at L 8-64", "it fits"),
            ("sm_90 row group 32 batch 1+", "Gluon at L 8-64", "it fits"),
            ("sm_90 row group 64 batch 9-32", "Gluon at L 8-64", "it fits"),
            ("lowering", "triton", "the portable path")]
    assert _merged_groups(rows) == [("sm_90 groups 4, 8 batch 1+", "Triton at every L", "it fits"),
                                    ("sm_90 groups 16, 32 batch 1+", "Gluon at L 8-64", "it fits"),
                                    ("sm_90 row group 64 batch 9-32", "Gluon at L 8-64", "it fits"),
                                    ("lowering", "triton", "the portable path")]
