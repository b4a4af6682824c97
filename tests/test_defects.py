"""Defects users found: CPU tensors without the interpreter, unknown load arguments, loose table
types, explain's dtype and group arguments, the layout README pointer, the help's usage lines."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_runtime_support import runtime_case, to_pages

import kgen
from kgen.blockconfig import DEFAULTS_FILE, TABLE_DIR, read_defaults, read_table, shipped_tables
from kgen.cli import build_parser, main
from kgen.errors import SpecError, TableError, UsageError
from kgen.spec import LAYOUT_README, LAYOUT_README_NAME, AttentionShape, Dtypes, LayoutSpec, parse_layout
from kgen.targets import read_targets

REPO = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------- CPU tensors without the interpreter

NO_INTERPRETER = textwrap.dedent(
    """
    import torch
    from test_runtime_support import runtime_case, to_pages
    import kgen

    mod = kgen.load("gqa64", "bf16")
    assert not mod.LAUNCHER.interpret
    case = runtime_case([20, 0, 13], [2, 1, 3], h_kv=1, group=8, d_qk=64, d_v=64,
                     q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    o = case.out()
    args = (case.q, case.k, case.v, o, case.k_buffer, case.v_buffer, case.qo_indptr, case.kv_indptr,
            case.kv_indices, None, True, None, case.max_len, 1.0, 1.0)
    print("flat", mod.verify_shared_kv_fwd(*args), mod.why_not(*args))
    p = to_pages(case, 16)
    paged = (case.q, case.k, case.v, o, p["k_cache"], p["v_cache"], p["block_table"], p["prefix_lens"],
             case.qo_indptr, case.max_len)
    print("paged", mod.verify_paged_fwd(*paged), mod.why_not_paged(*paged))
    assert o.isnan().all()
    """
)


def test_cpu_tensors_without_the_interpreter_are_refused_not_raised():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(REPO), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", NO_INTERPRETER], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    for entry in ("flat", "paged"):
        assert lines[entry].startswith("False "), lines[entry]
        assert "TRITON_INTERPRET=1" in lines[entry] and "CUDA tensors" in lines[entry]


def test_prefix_lens_on_another_device_is_refused():
    case = runtime_case([20, 13], [2, 3], h_kv=1, group=8, d_qk=64, d_v=64, q_dtype=torch.bfloat16,
                     kv_dtype=torch.bfloat16)
    pages = to_pages(case, 16)
    mod = kgen.load("gqa64", "bf16")
    o = case.out()
    args = (case.q, case.k, case.v, o, pages["k_cache"], pages["v_cache"], pages["block_table"],
            pages["prefix_lens"].to("meta"), case.qo_indptr, case.max_len)
    assert "prefix_lens is on meta" in mod.why_not_paged(*args)
    assert mod.verify_paged_fwd(*args) is False and o.isnan().all()


# ----------------------------------------------------------------- kgen.load arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layout": "gqa64", "variant": "banana"}, r"unknown variant 'banana'; expected one of 'grouped', 'per_head'"),
        ({"layout": "gqa65"}, r"unknown layout 'gqa65'; expected one of gqa128, gqa64, mla_absorbed_512_64"),
        ({"layout": "../generated/verify_gqa64"}, r"unknown layout '\.\./generated/verify_gqa64'"),
        ({"layout": "gqa64", "kv_dtype": "int8"}, r"unknown KV dtype 'int8'; expected one of bfloat16, .* bf16, "),
    ],
)
def test_load_refuses_unknown_arguments(kwargs, message):
    with pytest.raises(UsageError, match=message):
        kgen.load(**kwargs)


def test_load_accepts_both_variants():
    assert kgen.load("gqa64", variant="grouped").VARIANT == "grouped"
    assert kgen.load("gqa64", variant="per_head").VARIANT == "per_head"


# ----------------------------------------------------------------- strict table types


def _entry_config(table: dict, row: int, **fields) -> dict:
    entries = [dict(e) for e in table["entries"]]
    entries[row] = {**entries[row], "config": {**entries[row]["config"], **fields}}
    return {**table, "entries": entries}


WRONG_TYPES = [
    (lambda t: _entry_config(t, 1, block_n="64"), "entries.1.config.block_n", "valid integer", "'64' of type str"),
    (lambda t: _entry_config(t, 1, num_warps=4.0), "entries.1.config.num_warps", "valid integer", "4.0"),
    (lambda t: _entry_config(t, 1, lazy_rescale=1), "entries.1.config.lazy_rescale", "valid boolean", "1 of type int"),
    (lambda t: _entry_config(t, 1, kpack=True), "entries.1.config.kpack", "must be an integer", "True"),
    (lambda t: _entry_config(t, 1, split={"programs_per_sm": "2"}), "entries.1.config.split.programs_per_sm",
     "valid integer", "'2'"),
    (lambda t: {**t, "entries": [t["entries"][0], {**t["entries"][1], "group_size": "8"}]},
     "entries.1.group_size", "valid integer", "'8'"),
    (lambda t: {**t, "metadata": {**t["metadata"], "tuned": "yes"}}, "metadata.tuned", "valid boolean", "'yes'"),
]


@pytest.mark.parametrize(("mutate", "field", "reason", "given"), WRONG_TYPES)
def test_wrong_types_in_a_table_are_refused_naming_file_row_and_field(tmp_path, mutate, field, reason, given):
    table = json.loads((TABLE_DIR / "sm_90.json").read_text())
    path = tmp_path / "sm_90.json"
    path.write_text(json.dumps(mutate(table)))
    with pytest.raises(TableError) as info:
        read_table(path)
    message = str(info.value)
    assert f"{path}: field '{field}'" in message
    assert reason in message and given in message
    if field.startswith("entries.1."):
        row = table["entries"][1]
        assert f"(row 1: layout '{row['layout']}', kv_dtype '{row['kv_dtype']}'" in message


def test_wrong_types_in_the_defaults_are_refused(tmp_path):
    defaults = json.loads(DEFAULTS_FILE.read_text())
    defaults["rules"][0]["config"]["block_h"] = "16"
    path = tmp_path / "defaults.json"
    path.write_text(json.dumps(defaults))
    with pytest.raises(TableError, match=r"field 'rules\.0\.config\.block_h' \(row 0: max_qk_dim \d+.*valid integer"):
        read_defaults(path)


def test_shipped_tables_and_defaults_are_strictly_valid():
    read_defaults()
    read_targets()
    for path in shipped_tables().values():
        read_table(path)


# ----------------------------------------------------------------- kgen explain arguments


@pytest.mark.parametrize(("flag", "value"), [("--kv-dtype", "int8"), ("--q-dtype", "fp8")])
def test_explain_unknown_dtype_is_a_clean_error(capsys, flag, value):
    assert main(["explain", "qwen3_5_gqa256", flag, value]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"kgen explain: error: unknown {'KV' if flag == '--kv-dtype' else 'query'} dtype '{value}'" in err
    assert "expected one of bfloat16, float16" in err


def test_explain_warns_about_an_unlisted_group(capsys):
    assert main(["explain", "qwen3_5_gqa256", "--group", "3", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"warning: group 3 is not one of qwen3_5_gqa256's listed groups \[4, 8, 16\]: .*default block\s+"
                     r"config", out, re.S)
    assert re.search(r"^run time +sm_90 group 3 += H16 N32 w4 s3 2/64/128 — the default: no row for this group$",
                     out, re.M)


def test_explain_listed_group_has_no_group_warning(capsys):
    # (Under another Triton than the tables were tuned with, explain also warns about that.)
    assert main(["explain", "qwen3_5_gqa256", "--group", "8", "--arch", "sm_90"]) == 0
    assert "listed groups" not in capsys.readouterr().out


def test_explain_refuses_a_group_below_one(capsys):
    assert main(["explain", "qwen3_5_gqa256", "--group", "0"]) == 2
    assert "--group must be a positive number" in capsys.readouterr().err


# ----------------------------------------------------------------- the layout README


def test_unknown_key_error_points_to_an_existing_readme():
    text = (LAYOUT_README.parent / "gqa64.toml").read_text().replace('kind = "gqa"', 'kind = "gqa"\nheads = 8')
    with pytest.raises(SpecError, match="unknown key") as info:
        parse_layout(text, "gqa64.toml")
    assert f"see {LAYOUT_README_NAME} for the fields" in str(info.value)
    assert (REPO / LAYOUT_README_NAME).is_file()


def test_layout_readme_documents_every_field():
    readme = LAYOUT_README.read_text()
    fields = [*LayoutSpec.model_fields, *AttentionShape.model_fields, *Dtypes.model_fields]
    missing = [f for f in fields if f != "source" and f"`{f}`" not in readme and f"`[{f}]`" not in readme]
    assert not missing, f"{LAYOUT_README_NAME} does not describe {missing}"


# ----------------------------------------------------------------- usage lines in --help

PLACEHOLDERS = {"LAYOUT": "qwen3_5_gqa256", "D": "bf16", "G": "8"}


def _help_texts() -> dict[str, str]:
    parser = build_parser()
    texts = {"kgen": parser.format_help()}
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():
        texts[f"kgen {name}"] = sub.format_help()
    return texts


def _documented_commands(text: str) -> list[str]:
    """The example command lines of one help text, without their descriptions or comments.

    A description starts at the column most lines of the text align theirs to (after two or
    more spaces); lines that reach past that column without a gap there are all command."""
    lines = [line for line in text.splitlines() if re.match(r"\s+kgen ", line)]
    columns = Counter(m.end() for line in lines if (m := re.search(r"\S {2,}(?=\S)", line)))
    column = columns.most_common(1)[0][0] if columns else None
    commands = []
    for line in lines:
        if column and len(line) > column and line[column - 1] == " ":
            line = line[:column]
        line = line.split("#", 1)[0]
        commands += [part.strip() for part in line.split(";") if part.strip()]
    return commands


def _argv(command: str) -> list[str]:
    words = []
    for word in shlex.split(command.replace("[", " ").replace("]", " "))[1:]:
        if word == "...":
            continue
        if re.fullmatch(r"[A-Z][A-Z_]*", word):
            assert word in PLACEHOLDERS, f"add a value for the placeholder {word} of {command!r}"
        words.append(PLACEHOLDERS.get(word, word))
    return words


def test_every_documented_usage_line_parses():
    checked = 0
    for where, text in _help_texts().items():
        for command in _documented_commands(text):
            argv = _argv(command)
            try:
                args = build_parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"`{where} --help` documents {command!r}, which its parser refuses")
            assert args.command == argv[0]
            checked += 1
    assert checked >= 10
