"""The ``kgen`` command as a newcomer meets it: exit codes and messages (issue 26).

Bad values exit 2 with a message naming what is wrong and the fix; a bare ``kgen`` lists the
commands; ``--help`` and the module docstring say what is true.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from case_tools import set_draft_masks
from kernel_cases import tolerance

import kgen.cli
from kgen.cli import build_parser, main
from kgen.problems import eagle_tree, make_case
from kgen.reference import relative_error
from kgen.spec import SHIPPED_LAYOUT_DIR, load_layouts
from kgen.targets import read_targets

TARGETS = list(read_targets())


def _subcommands() -> list[str]:
    parser = build_parser()
    return list(next(a for a in parser._actions if a.dest == "command").choices)


# ----------------------------------------------------------------- kgen explain --arch


@pytest.mark.parametrize("arch", ["bogus", "sm_75", "gfx90a"])
def test_explain_refuses_an_arch_outside_the_targets_naming_them(capsys, arch):
    assert main(["explain", "gqa128", "--arch", arch]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing explained before the refusal
    assert f"kgen explain: error: unknown --arch '{arch}'" in captured.err
    assert ", ".join(TARGETS) in captured.err and "kgen/tables/targets.json" in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("arch", TARGETS)
def test_explain_takes_every_target(capsys, arch):
    assert main(["explain", "gqa128", "--arch", arch]) == 0
    out = capsys.readouterr().out
    assert main(["explain", "gqa128", "--arch", arch, "--verbose"]) == 0
    verbose = capsys.readouterr().out
    assert "── runtime gate" in verbose and f"device: {arch}" in verbose
    assert re.search(r"^gate +decision = \w+ — LlamaForCausalLM, topk 1, group 16$", out, re.M)


# ----------------------------------------------------------------- --topk and --group: exit 2 everywhere


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "gqa128", "--topk", "0"], "--topk must be EAGLE's branches per step, a whole number >= 1"),
        (["explain", "gqa128", "--topk", "-2"], "--topk must be EAGLE's branches per step, a whole number >= 1"),
        (["explain", "gqa128", "--group", "0"], "--group must be a positive number of query heads per KV head"),
        (["explain", "gqa128", "--group", "-1"], "--group must be a positive number of query heads per KV head"),
        (["tune", "--dry-run", "--arch", "sm_90", "--layout", "gqa128", "--group", "0"],
         "group size(s) [0] belong to no selected layout"),
        (["bench", "--list", "--layout", "gqa128:0"], "layout gqa128 is generated for groups [8, 16], not '0'"),
    ],
)
def test_bad_topk_and_group_exit_2_with_the_reason(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "cannot evaluate" not in captured.out and "Traceback" not in captured.err


def test_a_topk_that_is_no_number_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["explain", "gqa128", "--topk", "two"])
    assert info.value.code == 2
    assert "argument --topk: invalid int value: 'two'" in capsys.readouterr().err


@pytest.mark.parametrize("topk", ["1", "4"])
def test_explain_serves_chains_and_trees(capsys, topk):
    assert main(["explain", "gqa128", "--topk", topk, "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^gate +decision = grouped — LlamaForCausalLM, topk {topk}, group 16$", out, re.M)
    assert ("a chain" if topk == "1" else "a tree") in out


# ----------------------------------------------------------------- kgen explain --model


def test_explain_refuses_a_model_another_layout_serves(capsys):
    """The gate would explain qwen3_5_gqa256 under gqa128's passes: refused, with the command that explains it."""
    assert "Qwen3_5MoeForCausalLM" in load_layouts()["qwen3_5_gqa256"].architectures
    assert main(["explain", "gqa128", "--model", "Qwen3_5MoeForCausalLM", "--arch", "sm_90"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--model 'Qwen3_5MoeForCausalLM' is served by layout qwen3_5_gqa256, not 'gqa128'" in captured.err
    assert "`kgen explain qwen3_5_gqa256 --model Qwen3_5MoeForCausalLM`" in captured.err
    assert "gqa128.toml" in captured.err  # where to route it instead


def test_explain_a_model_of_its_own_layout(capsys):
    assert main(["explain", "qwen3_5_gqa256", "--model", "Qwen3_5MoeForCausalLM", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^gate +decision = grouped — Qwen3_5MoeForCausalLM, topk 1, group 16$", out, re.M)
    assert "layout 'qwen3_5_gqa256' (group 16)" in out  # the gate's reason names the layout


def test_explain_a_model_no_layout_lists_says_how_to_route_it(capsys):
    assert main(["explain", "gqa128", "--model", "MistralForCausalLM", "--arch", "sm_90", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "qk 128, pe 0, v 128" in out  # evaluated with the explained layout's widths
    assert "no layout lists model architecture 'MistralForCausalLM'" in out and "`architectures`" in out
    assert "decision: general (layout None)" in out


# ----------------------------------------------------------------- bare kgen, --help, the docstring


def test_bare_kgen_lists_every_command_one_line_each(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    for name in _subcommands():
        lines = [line for line in err.splitlines() if re.match(rf"\s+kgen {name}\b", line)]
        assert len(lines) == 1, f"{name}: {lines}"
        assert len(lines[0].split()) > 2, f"{name} has no description: {lines[0]!r}"
    assert "kgen: error: name a command" in err


def test_help_says_trees_are_served():
    text = build_parser().format_help()
    assert "topk > 1" in text
    assert "EAGLE topk = 1)" not in text


def test_help_and_docstring_name_every_command():
    help_text = build_parser().format_help()
    for name in _subcommands():
        assert re.search(rf"^\s+kgen {name}\b", help_text, re.M), f"--help lists no `kgen {name}`"
        assert name in kgen.cli.__doc__, f"kgen/cli.py's docstring leaves out {name}"


# ----------------------------------------------------------------- --layout-dir


@pytest.fixture
def one_layout_dir(tmp_path):
    """A layout directory holding only gqa64."""
    layouts = tmp_path / "layouts"
    layouts.mkdir()
    (layouts / "gqa64.toml").write_text((SHIPPED_LAYOUT_DIR / "gqa64.toml").read_text())
    return layouts


def test_layout_dir_reads_that_directory(tmp_path, capsys, one_layout_dir):
    assert main(["list", "--layout-dir", str(one_layout_dir)]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:] if not line.startswith(" ")]
    assert listed == ["gqa64"]
    # build: an empty --out is stale for gqa64's modules only
    assert main(["build", "--check", "-q", "--out", str(tmp_path / "gen"), "--layout-dir", str(one_layout_dir)]) == 1
    stale = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stale: ")]
    assert stale and all("gqa64__" in line for line in stale)


def test_layouts_still_works_and_says_it_is_deprecated(capsys, one_layout_dir):
    assert main(["list", "--layouts", str(one_layout_dir)]) == 0
    captured = capsys.readouterr()
    assert "gqa64" in captured.out and "gqa128" not in captured.out
    assert "warning: --layouts is deprecated, use --layout-dir" in captured.err
    list_help = next(a for a in build_parser()._actions if a.dest == "command").choices["list"].format_help()
    assert "--layout-dir DIR" in list_help and "--layouts" not in list_help


# ----------------------------------------------------------------- the README a newcomer reads

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.M | re.S)


def _blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(README)]


def test_readme_first_two_bash_blocks_are_the_setup_and_the_tests():
    """CI and a fresh machine run these two; every other block must not look like them."""
    bash = [body.strip() for lang, body in _blocks() if lang == "bash"]
    assert bash == ["bash scripts/setup-dev.sh && kgen build", "python -m pytest -q -n auto"]
    assert {lang for lang, _ in _blocks()} <= {"bash", "sh", "console", "text", "python"}


def test_readme_engine_check_prints_what_it_shows(capsys):
    """The engine user's can_handle check, on CPU tensors in the interpreter instead of CUDA ones."""
    console = next(body for lang, body in _blocks() if lang == "console" and "can_handle" in body)
    script, shown = re.search(r"<<'PY'\n(.*?)\nPY\n(.*?)\n", console, re.S).groups()
    assert 'device="cuda"' in script
    exec(compile(script.replace('device="cuda"', 'device="cpu"'), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == shown.strip()


def test_readme_call_example_runs_and_is_right():
    """The keyword call of "Using a generated kernel", run as written on a tree (its last call)."""
    example = next(body for lang, body in _blocks() if lang == "python" and "verify_shared_kv_fwd" in body)
    case = make_case(load_layouts()["qwen3_5_gqa256"], [30, 9], [5, 3], 4, seed=3)
    set_draft_masks(case, [eagle_tree(n, seed=b) for b, n in enumerate(case.draft_lens())])
    names = dict(q=case.q, k=case.k_extend, v=case.v_extend, o=case.o, k_buffer=case.k_buffer,
                 v_buffer=case.v_buffer, qo_indptr=case.qo_indptr, kv_indptr=case.kv_indptr,
                 kv_indices=case.kv_indices, max_len_extend=case.max_len_extend,
                 custom_mask=case.custom_mask, mask_indptr=case.mask_indptr)
    exec(compile(example, "README.md", "exec"), names)
    assert names["ok"] is True
    assert relative_error(case.o, case.reference(torch.float64)) <= tolerance(case)


def test_check_count_counts_and_the_old_flag_says_its_new_name(capsys):
    """`kgen check --count` counts variants without compiling; `--plan` ("plan" is the IR's name)
    still works and names its replacement."""
    argv = ["check", "--arch", "sm_90", "--layout", "gqa64", "--kv-dtype", "bf16", "--q-dtype", "bf16",
            "--variant", "grouped"]
    assert main([*argv, "--count"]) == 0
    counted = capsys.readouterr()
    assert "sm_90" in counted.out and "deprecated" not in counted.err
    assert main([*argv, "--plan"]) == 0
    aliased = capsys.readouterr()
    assert aliased.out == counted.out
    assert "--plan is deprecated, use --count" in aliased.err
