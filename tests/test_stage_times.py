"""benchmarks/stage_times.py's stage switches, in Triton's interpreter: the merge alone reproduces the
call's output from the partials a whole call left; the prefix alone leaves the merged rows unwritten;
leaving the `with` block gives the shipped call back. (The timings themselves need the GPU.)"""

import sys
from pathlib import Path

import pytest
import torch

import kgen
from kgen.bench.cases import case_for
from kgen.bench.inputs import build_inputs
from kgen.bench.peers import kgen_run
from kgen.spec import load_layouts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from stage_times import launch_count, parse_args, skipping  # noqa: E402


def test_each_stage_alone_and_the_call_restored() -> None:
    case = case_for(load_layouts()["gqa128"], 8, "bfloat16", 1, 1024, 2)
    inputs = build_inputs(case, "cpu")
    module = kgen.load("gqa128")
    assert launch_count(module, case, torch.device("cpu")) == 2  # the grid has splits: a merge
    call, o = kgen_run(case, inputs, "grouped").fn, inputs.sets[0].o

    o.fill_(float("nan"))
    call(0)
    whole = o.clone()
    assert not whole.isnan().any()

    o.fill_(float("nan"))
    with skipping(module.LAUNCHER, "prefix"):
        call(0)  # the merge on the partials the whole call left
    assert torch.equal(o, whole)

    o.fill_(float("nan"))
    with skipping(module.LAUNCHER, "merge"):
        call(0)
    assert o.isnan().all()  # every row is merged: the prefix stage wrote partials only

    o.fill_(float("nan"))
    call(0)
    assert torch.equal(o, whole)
    assert "launch_merge" not in vars(module.LAUNCHER) and "launch_triton_prefix" not in vars(module.LAUNCHER)


def test_the_gluon_stage_is_switched_off_and_back() -> None:
    """The Gluon lowering (no interpreter run) is switched the same way: its instance's launch."""
    from types import SimpleNamespace

    from kgen.launcher.gluon import GluonPrefixStage

    stage = GluonPrefixStage()
    launcher = SimpleNamespace(prefix_lowerings={"gluon": stage})
    shipped = stage.launch
    with skipping(launcher, "prefix"):
        assert stage.launch is not shipped and stage.launch(None, None) is None
        assert launcher.launch_triton_prefix() is True
    assert stage.launch is shipped and "launch" not in vars(stage)
    assert "launch_triton_prefix" not in vars(launcher)


def test_the_command_line_takes_short_names_and_refuses_bad_ones(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--layout", "qwen3_5_gqa256:16,gqa128:8", "--kv-dtype", "fp8", "--batch", "1,16",
                       "--prefix", "1K"])
    assert args.kv_dtype == "float8_e4m3fn" and args.layouts == [("qwen3_5_gqa256", 16), ("gqa128", 8)]
    assert args.batches == [1, 16] and args.prefixes == [1024]
    assert parse_args(["--layout", "gqa128:8", "--batch", "1", "--prefix", "1K"]).kv_dtype == "bfloat16"
    for bad, named in ((["--kv-dtype", "bf17"], "bf17"), (["--kv-dtype", "bf16,fp8"], "one KV dtype"),
                       (["--layout", "gqa129:8"], "gqa129")):
        argv = ["--layout", "gqa128:8", "--batch", "1", "--prefix", "1K", *bad]
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert named in capsys.readouterr().err
