"""kgen bench: inputs and the kernels' formulations, on tiny CPU problems (nothing timed).

The peers' masks and head layouts are checked against ``kgen.reference`` here, so a GPU
run only has speed left to find out. FlexAttention runs eagerly (no compile: too slow for
CI); SDPA runs with whatever CPU backends exist; the generated kernels run in Triton's
interpreter in a subprocess (the interpreter is chosen when triton is imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kgen.bench.cases import build_matrix, case_for
from kgen.bench.inputs import (
    FP8_K_SCALE,
    FP8_V_SCALE,
    build_inputs,
    build_peer_inputs,
    case_seed,
    draft_mask,
    rows_from_folded,
    rows_from_heads,
)
from kgen.bench.measure import TOLERANCE_BF16, run_matrix
from kgen.bench.peers import (
    DeviceProvider,
    config_label,
    flex_label,
    flex_run,
    kgen_run,
    parse_flex_label,
    scratch_bytes_of,
    sdpa_forms,
    sdpa_run,
)
from kgen.bench.timing import Timing
from kgen.problems import draft_affinity_for, make_case
from kgen.reference import reference_verify, relative_error
from kgen.spec import load_layouts

SPECS = load_layouts()


def fake_timer(fn, n_sets: int) -> Timing:  # noqa: ANN001
    fn(n_sets - 1)  # every set must be launchable
    return Timing(10.0, 9.0, 11.0, launches=n_sets, mode="fake")


class ReferenceModule:
    """Stands in for a generated module: computes o with the reference (optionally with the
    draft tail's causal mask dropped, to prove the check catches it)."""

    def __init__(self, causal: bool = True) -> None:
        self.causal = causal
        self.index_dtypes: list[torch.dtype] = []

    def launch(self, q, k_ext, v_ext, o, k_buf, v_buf, qo, kvp, kvi, max_len, k_scale, v_scale):  # noqa: ANN001, ANN201
        self.index_dtypes.append(kvi.dtype)
        kb = k_buf.float() if k_buf.element_size() == 1 else k_buf
        vb = v_buf.float() if v_buf.element_size() == 1 else v_buf
        if self.causal:
            o.copy_(reference_verify(q, k_ext, v_ext, kb, vb, qo, kvp, kvi, k_scale, v_scale))
            return
        L = max_len  # every draft token sees the whole draft: put it last, then take that row
        for r in range(o.shape[0]):
            b, i = divmod(r, L)
            rows = slice(b * L, (b + 1) * L)
            swapped = q[rows].clone()
            swapped[[i, L - 1]] = swapped[[L - 1, i]]
            full = reference_verify(swapped, k_ext[rows], v_ext[rows], kb, vb,
                                    torch.tensor([0, L], dtype=torch.int32), kvp[b : b + 2] - kvp[b],
                                    kvi[kvp[b]:], k_scale, v_scale)  # fmt: skip
            o[r] = full[L - 1]

    def scratch_bytes(self, num_tokens, num_q_heads, num_kv_heads, batch, max_len, arch, num_sms, config=None):  # noqa: ANN001, ANN201, E501
        return num_tokens * num_q_heads * 4

    def select_config(self, arch, group, batch):  # noqa: ANN001, ANN201
        return {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2, "split": {"programs_per_sm": 2}}


CASES = [
    ("qwen3_5_gqa256", 4, "bfloat16", 3),
    ("mla_absorbed_512_64", 16, "float8_e4m3fn", 2),
    ("gqa128", 8, "float8_e4m3fn", 1),
]


def _case(layout: str, group: int, kv: str, draft: int, batch: int = 3, prefix: int = 96):  # noqa: ANN202
    return case_for(SPECS[layout], group, kv, batch, prefix, draft)


def test_inputs_are_a_shuffled_paged_pool() -> None:
    case = _case("qwen3_5_gqa256", 16, "float8_e4m3fn", 4, batch=2, prefix=64)
    inp = build_inputs(case, "cpu", n_sets=3)
    assert inp.k_buffer.shape == (3 * 2 * 64, 1, 256) and inp.k_buffer.dtype == torch.float8_e4m3fn
    assert inp.v_buffer.shape == (3 * 2 * 64, 1, 256)
    assert inp.k_scale == FP8_K_SCALE and inp.v_scale != 1.0
    assert inp.qo_indptr.tolist() == [0, 4, 8] and inp.kv_indptr.tolist() == [0, 64, 128]
    assert inp.qo_indptr.dtype == inp.kv_indptr.dtype == torch.int32
    slots = torch.cat([s.kv_indices for s in inp.sets])
    assert slots.dtype == torch.int64  # what SGLang sends
    assert sorted(slots.tolist()) == list(range(3 * 2 * 64))  # disjoint sets cover the pool
    assert not torch.equal(inp.sets[0].kv_indices, torch.arange(128, dtype=torch.int64))
    s = inp.sets[1]
    assert s.q.shape == (8, 16, 256) and s.q.dtype == torch.bfloat16
    assert s.k_extend.shape == s.v_extend.shape == (8, 1, 256)
    assert torch.isnan(s.o.float()).all()  # unwritten output cannot pass the check


def test_mla_v_is_a_view_of_k() -> None:
    inp = build_inputs(_case("mla_absorbed_512_64", 16, "bfloat16", 2), "cpu")
    assert inp.v_buffer.data_ptr() == inp.k_buffer.data_ptr() and inp.v_buffer.shape[-1] == 512
    s = inp.sets[0]
    assert s.v_extend.data_ptr() == s.k_extend.data_ptr() and s.v_extend.shape[-1] == 512


def test_peer_layouts_round_trip() -> None:
    case = _case("gqa128", 8, "bfloat16", 3, batch=2)
    inp = build_inputs(case, "cpu")
    pin = build_peer_inputs(inp)
    q = inp.sets[0].q
    assert torch.equal(rows_from_heads(pin.q[0], case), q)
    assert torch.equal(rows_from_folded(pin.q_folded[0], case), q)
    assert pin.k[0].shape == (2, 1, 96 + 3, 128) and pin.k[0].is_contiguous()


def test_draft_mask() -> None:
    mask = draft_mask(5, 3, 2, "cpu")
    assert mask.shape == (1, 1, 6, 8) and mask.stride(-2) % 16 == 0
    visible = (mask[0, 0] == 0).int().tolist()
    assert visible[0] == [1] * 6 + [0, 0]  # draft 0: prefix + itself
    assert visible[2] == [1] * 8  # draft 2 (last): everything
    assert visible[3] == visible[0]  # next head, draft 0 again


@pytest.mark.parametrize(("layout", "group", "kv", "draft"), CASES)
def test_sdpa_matches_reference(layout: str, group: int, kv: str, draft: int) -> None:
    case = _case(layout, group, kv, draft)
    inp = build_inputs(case, "cpu", n_sets=2)
    run = sdpa_run(case, build_peer_inputs(inp), inp, fake_timer)
    assert run.fn is not None, run.unsupported
    assert run.check() < TOLERANCE_BF16
    assert run.choice.split("/")[0] in sdpa_forms(case) and "selected" in run.note


@pytest.mark.parametrize(("layout", "group", "kv", "draft"), CASES)
def test_flex_eager_matches_reference(layout: str, group: int, kv: str, draft: int) -> None:
    case = _case(layout, group, kv, draft)
    inp = build_inputs(case, "cpu", n_sets=2)
    run = flex_run(case, build_peer_inputs(inp), inp, compile=False)
    assert run.fn is not None, run.unsupported
    assert run.check() < TOLERANCE_BF16 and run.choice == "default"


def test_flex_labels() -> None:
    opts = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    assert flex_label(opts) == "BLOCK_N=32,num_warps=4,num_stages=2"
    assert parse_flex_label(flex_label(opts)) == opts
    assert parse_flex_label("default") is None and flex_label(None) == "default"
    assert parse_flex_label("PRESCALE_QK=True") == {"PRESCALE_QK": True}


@pytest.mark.parametrize(("layout", "group", "kv", "draft"), CASES)
def test_kgen_check_passes_right_and_fails_wrong(layout: str, group: int, kv: str, draft: int) -> None:
    case = _case(layout, group, kv, draft)
    inp = build_inputs(case, "cpu")
    good = kgen_run(case, inp, "grouped", loader=lambda *a: ReferenceModule())
    assert good.check() < TOLERANCE_BF16
    assert good.scratch_bytes == case.num_tokens * case.num_q_heads * 4
    assert good.choice.startswith("BLOCK_H=16 BLOCK_N=64")
    if draft > 1:
        wrong = kgen_run(case, inp, "grouped", loader=lambda *a: ReferenceModule(causal=False))
        assert wrong.check() > 0.1


def test_kgen_load_failure_is_an_error() -> None:
    def loader(*args: str):  # noqa: ANN202
        raise ImportError("generated module missing")

    run = kgen_run(_case("gqa128", 8, "bfloat16", 1), build_inputs(_case("gqa128", 8, "bfloat16", 1), "cpu"),
                   "grouped", loader=loader)  # fmt: skip
    assert run.fn is None and "generated module missing" in run.error


def test_scratch_bytes_signatures() -> None:
    case = _case("gqa128", 8, "bfloat16", 2, batch=4)

    class DesignNote:  # docs/design.md's spelling
        def scratch_bytes(self, num_tokens, num_q_heads, batch, config=None, num_sms=None):  # noqa: ANN001, ANN201
            return num_tokens * 1000 + num_q_heads * 100 + batch * 10 + (num_sms or 0)

    class Unknown:
        def scratch_bytes(self, tokens):  # noqa: ANN001, ANN201
            return 1

    assert scratch_bytes_of(DesignNote(), case, "sm_90", 7) == 8 * 1000 + 8 * 100 + 4 * 10 + 7
    assert scratch_bytes_of(Unknown(), case, "sm_90", 132) is None
    assert scratch_bytes_of(object(), case, "sm_90", 132) is None


def test_relative_error_in_the_max_norm() -> None:
    ref = torch.tensor([[1.0, -2.0]])
    assert relative_error(ref.bfloat16(), ref, "max") == 0.0
    assert relative_error(torch.tensor([[1.0, -1.0]]), ref, "max") == pytest.approx(0.5)
    assert relative_error(torch.tensor([[float("nan"), 1.0]]), ref, "max") == float("inf")
    # One wrong element of many: the max norm sees it whole, the L2 norm averages it away.
    big = torch.ones(1, 100)
    one_off = big.clone()
    one_off[0, 0] = 1.5
    assert relative_error(one_off, big, "max") == pytest.approx(0.5)
    assert relative_error(one_off, big) == pytest.approx(0.05)


def test_input_sets_are_slices_of_one_make_case_problem() -> None:
    """The bench's inputs come from kgen.problems.make_case (one builder): set s is requests
    s * batch onwards of one problem with the case's seed, dtypes, scales and draft affinity."""
    case = _case("gqa128", 8, "float8_e4m3fn", 3, batch=2, prefix=40)
    inp = build_inputs(case, "cpu", n_sets=2, seed=5)
    full = make_case(SPECS["gqa128"], [40] * 4, [3] * 4, 8, kv_dtype="float8_e4m3fn", k_scale=FP8_K_SCALE,
                     v_scale=FP8_V_SCALE, spare_slots=0, index_dtype=torch.int64, seed=case_seed(case, 5),
                     draft_affinity=draft_affinity_for(40, 128))
    assert torch.equal(inp.k_buffer.view(torch.uint8), full.k_buffer.view(torch.uint8))
    assert torch.equal(inp.sets[1].q, full.q[6:12]) and torch.equal(inp.sets[1].kv_indices, full.kv_indices[80:])
    assert torch.equal(inp.sets[0].k_extend, full.k_extend[:6])


def test_device_provider_end_to_end_on_cpu(tmp_path: Path) -> None:
    """The real provider (inputs, four kernels, checks) through run_matrix, fake timer."""
    cases = build_matrix(SPECS, [("gqa128", 8)], ["bfloat16", "float8_e4m3fn"], batches=[2], prefixes=[64],
                         drafts=[2])  # fmt: skip
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False,
                              select_timer=fake_timer, loader=lambda *a: ReferenceModule())  # fmt: skip
    results = run_matrix(cases, provider, fake_timer, 1000.0)
    assert [r.status for r in results] == ["ok", "ok"]
    for res in results:
        assert {k: v.status for k, v in res.kernels.items()} == dict.fromkeys(
            ("grouped", "per_head", "flex", "sdpa"), "ok"
        )
        assert res.input_sets > 1 and res.speedup == {"per_head": 1.0, "flex": 1.0, "sdpa": 1.0}
    assert results[1].kernels["sdpa"].shared_from == results[0].key


def test_inputs_for_an_index_dtype_ab_hold_one_permutation_in_both_dtypes() -> None:
    case = case_for(SPECS["gqa128"], 8, "bfloat16", 2, 32, 2, index_dtype="int64", index_dtype_ab="int32")
    inp = build_inputs(case, "cpu", n_sets=2)
    for s in inp.sets:
        assert s.kv_indices.dtype == torch.int64 and s.kv_indices_ab.dtype == torch.int32
        assert torch.equal(s.kv_indices, s.kv_indices_ab.long())
        assert s.indices("int32") is s.kv_indices_ab and s.indices("int64") is s.kv_indices
    plain = build_inputs(case_for(SPECS["gqa128"], 8, "bfloat16", 2, 32, 2, index_dtype="int32"), "cpu", n_sets=2)
    assert plain.sets[0].kv_indices_ab is None and torch.equal(plain.sets[0].kv_indices.long(), inp.sets[0].kv_indices)
    with pytest.raises(ValueError, match="no int64 kv_indices"):
        plain.sets[0].indices("int64")


def test_kgen_run_launches_each_index_dtype_on_its_own_page_table() -> None:
    case = case_for(SPECS["gqa128"], 8, "bfloat16", 2, 32, 2, index_dtype="int64", index_dtype_ab="int32")
    inp = build_inputs(case, "cpu", n_sets=2)
    module = ReferenceModule()
    run = kgen_run(case, inp, "grouped", loader=lambda *a: module)
    assert run.index_dtype == "int64" and run.alt is not None and run.alt.index_dtype == "int32"
    assert run.check() < TOLERANCE_BF16 and run.alt.check() < TOLERANCE_BF16
    run.fn(1)
    run.alt.fn(1)
    assert module.index_dtypes == [torch.int64, torch.int32, torch.int64, torch.int32]
    single = kgen_run(case_for(SPECS["gqa128"], 8, "bfloat16", 2, 32, 2), build_inputs(
        case_for(SPECS["gqa128"], 8, "bfloat16", 2, 32, 2), "cpu"), "grouped", loader=lambda *a: module)
    assert single.alt is None and single.index_dtype == "int64"


def test_device_provider_unknown_kernel() -> None:
    provider = DeviceProvider(device="cpu", compile_flex=False, loader=lambda *a: ReferenceModule())
    with provider(_case("gqa128", 8, "bfloat16", 1), frozenset({"triton"})) as runs:
        assert "unknown kernel" in runs["triton"].error


_INTERPRETER_SCRIPT = """
import json, sys
from kgen.spec import load_layouts
from kgen.bench.cases import case_for
from kgen.bench.inputs import build_inputs
from kgen.bench.peers import kgen_run
specs = load_layouts()
out = {}
for n, (layout, group, kv, draft) in enumerate(json.loads(sys.argv[1])):
    # int64 kv_indices (SGLang's); the first case also checks the int32 page table
    case = case_for(specs[layout], group, kv, 2, 80, draft, index_dtype_ab=None if n else "int32")
    inputs = build_inputs(case, "cpu")
    for variant in ("grouped", "per_head"):
        run = kgen_run(case, inputs, variant)
        out[f"{case.key}/{variant}"] = run.error or run.check()
        if run.alt is not None and variant == "grouped":
            out[f"{case.key}/{variant}/int32"] = run.alt.check()
print(json.dumps(out))
"""


def test_generated_kernels_pass_the_check_in_the_interpreter() -> None:
    """The bench's own check on the real generated modules (Triton interpreter, tiny sizes)."""
    pytest.importorskip("numpy")
    cases = [("gqa128", 8, "bfloat16", 2), ("mla_absorbed_512_64", 16, "float8_e4m3fn", 3)]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == 5
    for name, err in errors.items():
        assert isinstance(err, float) and err < TOLERANCE_BF16, (name, err)


def test_flex_refusal_is_remembered_per_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head width FlexAttention refuses is tried once, not once per batch and prefix."""
    from kgen.bench import peers
    from kgen.bench.measure import KernelRun

    calls: list[str] = []

    def refuse(case, pin, inputs, options=None, compile=True):  # noqa: ANN001, ANN202
        calls.append(case.key)
        return KernelRun(unsupported="flex (default): head dim 576 not supported")

    monkeypatch.setattr(peers, "flex_run", refuse)
    provider = DeviceProvider(device="cpu", compile_flex=False, loader=lambda *a: ReferenceModule())
    notes = []
    for batch in (1, 2):
        case = _case("mla_absorbed_512_64", 16, "bfloat16", 2, batch=batch, prefix=32)
        with provider(case, frozenset({"flex"})) as runs:
            notes.append(runs["flex"].unsupported)
    assert len(calls) == 1
    assert "head dim 576" in notes[0] and "first refused at mla_absorbed_512_64/g16/bf16/bs1" in notes[1]


def test_draft_affinity_raises_the_draft_scores_of_each_request() -> None:
    """make_case's draft_affinity: a request's draft queries and keys share a direction, so
    q.k over the drafts stands above q.k over the prefix; zero leaves the draws unchanged."""
    spec = SPECS["gqa128"]
    plain = make_case(spec, [200, 200], [4, 3], 8, seed=3)
    again = make_case(spec, [200, 200], [4, 3], 8, seed=3, draft_affinity=0.0)
    assert torch.equal(plain.q, again.q) and torch.equal(plain.k_buffer, again.k_buffer)
    case = make_case(spec, [200, 200], [4, 3], 8, seed=3, draft_affinity=draft_affinity_for(200, 128))
    q, k_ext = case.q.float()[:4, 0], case.k_extend.float()[:4, 0]
    prefix = case.k_buffer.float()[case.kv_indices[:200].long(), 0]
    assert (q @ k_ext.T).mean() > 5 * (q @ prefix.T).abs().mean()


def test_the_choice_names_the_stage_the_launcher_picks() -> None:
    """A row whose gluon section launches at this draft length is labelled with that section,
    not with the Triton fields the call does not run (GQA 64 g8, batch 64: from 64 rows)."""
    import kgen

    module = kgen.load("gqa64", "bfloat16")
    module.LAUNCHER.gluon_enabled, enabled = True, module.LAUNCHER.gluon_enabled  # as under Triton 3.6
    try:
        spec = load_layouts()["gqa64"]
        short, long = (config_label(module, case_for(spec, 8, "bfloat16", 64, 16384, draft), "sm_90", 132)
                       for draft in (4, 8))
    finally:
        module.LAUNCHER.gluon_enabled = enabled
        module.LAUNCHER.cached_setup.cache_clear()
    assert short.startswith("BLOCK_H=") and long.startswith("Gluon BLOCK_N=128 stages=4"), (short, long)
