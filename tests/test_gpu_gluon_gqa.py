"""GQA's Gluon prefix stage (kgen/templates/gluon_gqa/) over its accepted domain.

Run on the H200 (sm_90, Triton 3.6), spread over processes:

    KGEN_TEST_ON_GPU=1 python -m pytest -q -m gpu tests/test_gpu_gluon_gqa.py -n 16 --dist loadgroup

Every GQA layout with the stage (a KV dtype its lowering.json lists: 16-bit with q in that
dtype, FP8 with one 16-bit q dtype each, fp8_q_pairs) runs through ``launch`` with a config
that carries a ``gluon`` section, so the launcher picks the Gluon kernel (asserted through
``launch_params``) whatever the shipped table holds:

- groups: each listed group and an unlisted one (1.5 x the largest: several programs a KV head,
  the last one partly padding); with them programs whose rows all fit the first consumer
  (GROUP x L_PAD <= 64: the second one returns at once) and programs that need both;
- draft lengths 1..MAX_DRAFT_TOKENS up to the key tile (every L_PAD class the kernel compiles)
  as a ragged batch with an empty prefix, prefixes that are not multiples of a tile and one
  long enough for several splits; kv_indices int32 and int64 at each layout's first group, int64
  at the others (domain_index_dtypes);
- 64-token tiles with 2 stages, 32-token tiles with 4 and the lazy rescale, and 128-token
  tiles with 3 where they fit shared memory (head dims 128 and 64), all with bf16 KV (FP8:
  e4m3fn); fp16 and e5m2 KV with 64-token tiles (dtype_config_pairs);
- FP8: two converters beside two consumers (converters 2, a fourth warpgroup; head dims 128 and
  64) as well as the launcher's rule (two only where consumer 1 has no rows), and one converter
  with a landing ring of 2 tiles (landing_stages; at head dim 256 where consumer 1 has no rows);
- NaN in every pool slot no request names, in o before the call and in the split scratch;
- separate K and V pools whose strides differ (V a view of a wider buffer);
- the batch-invariant module.

Its masks, paged entry and CUDA-graph replay run in tests/test_gpu_gluon.py beside MLA's.
"""

from __future__ import annotations

import pytest
import torch
from case_tools import poison_unnamed_slots
from kernel_cases import SPECS, tolerance
from test_gpu_gluon import (
    GLUON_CONFIGS,
    _assert_gluon,
    check_domain,
    domain_index_dtypes,
    dtype_config_pairs,
    fp8_q_pairs,
    gluon_config,
)
from test_gpu_sweep import unlisted_group

import kgen
from kgen.launcher import rules
from kgen.passes.select_lowering import second_lowerings
from kgen.problems import make_case
from kgen.reference import relative_error
from kgen.spec import FP8_DTYPES

PACKAGE = second_lowerings()["gluon_gqa_prefix"]
LAYOUTS = [name for name, spec in SPECS.items() if spec.attention.kind == "gqa"]
# The KV dtypes the stage serves (lowering.json's kv_dtype): a dtype added there runs here. A
# 16-bit pool takes queries in its own dtype; an FP8 one (the converting producer) either (run in
# pairs, fp8_q_pairs).
SERVED_KV = PACKAGE["requires"]["kv_dtype"]
KV16 = [kv for kv in SERVED_KV if kv not in FP8_DTYPES]
FP8_KV = [kv for kv in SERVED_KV if kv in FP8_DTYPES]
# The Gluon configs the tuner may pick: 64-token tiles with 2 stages, 32-token tiles with 4 and
# the lazy rescale, and (head dims 128 and 64, where they fit shared memory) 128-token tiles.
CONFIGS = {**{name: GLUON_CONFIGS[name] for name in ("n64s2", "n32s4lazy")},
           "n128s3": {"block_n": 128, "num_stages": 3, "lazy_rescale": False}}
# FP8: two converters at every program, beside two consumers a fourth warpgroup; one converter
# with a landing ring of 2 tiles (at head dim 256 where one consumer has rows: beside two, q
# leaves it no room and the converters take their rows through registers).
FP8_CONFIGS = {"n64s2c2": {"block_n": 64, "num_stages": 2, "lazy_rescale": False, "converters": 2},
               "n64s2l2": {"block_n": 64, "num_stages": 2, "lazy_rescale": False, "landing_stages": 2}}
ALL_CONFIGS = {**CONFIGS, **FP8_CONFIGS}
BATCH = 4


def _groups(layout: str) -> list[int]:
    groups = list(SPECS[layout].attention.group_sizes)
    return [*groups, unlisted_group(tuple(groups))]


def _fits(layout: str, kv_dtype: str, gluon: dict) -> bool:
    """The section fits shared memory and its converters and landing ring are the module's."""
    identity = kgen.load(layout, kv_dtype).LAUNCHER.identity
    shape = identity.kernel_shape
    if gluon.get("converters") and rules.gluon_converters_refusal(shape, gluon["converters"]):
        return False
    landing = gluon.get("landing_stages", 0)
    if landing and rules.gluon_landing_refusal(shape, landing, gluon.get("converters")):
        return False
    # A landing ring that does not fit a program is left out of it (rules.gluon_landing_stages).
    need = rules.gluon_shared_bytes(shape, gluon["block_n"], gluon["num_stages"])
    return need <= identity.targets["sm_90"]["shared_bytes"]


def _configs(layout: str, kv_dtype: str) -> list[str]:
    """The CONFIGS and FP8_CONFIGS that fit."""
    return [name for name, gluon in ALL_CONFIGS.items() if _fits(layout, kv_dtype, gluon)]


def _cases(dtypes: list) -> list[tuple]:
    """(layout, dtype, group, config) for every GQA layout and group: every config that fits
    with the first dtype (a KV dtype, or a (KV, q) pair), the first config with each further one
    (dtype_config_pairs)."""
    first_kv = dtypes[0][0] if isinstance(dtypes[0], tuple) else dtypes[0]
    return [(layout, dtype, group, name) for layout in LAYOUTS
            for dtype, name in dtype_config_pairs(dtypes, _configs(layout, first_kv))
            for group in _groups(layout)]


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "kv_dtype", "group", "config_name"), _cases(KV16))
def test_gluon_gqa_domain(layout, kv_dtype, group, config_name):
    module = kgen.load(layout, kv_dtype, kv_dtype)
    check_domain(module, layout, group, ALL_CONFIGS[config_name], kv_dtype, kv_dtype,
                 f"{layout}/{kv_dtype}/{group}/{config_name}", domain_index_dtypes(group, _groups(layout)))


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "kv_dtype", "q_dtype", "group", "config_name"),
                         [(layout, kv, q, group, name) for layout, (kv, q), group, name in _cases(fp8_q_pairs(FP8_KV))])
def test_gluon_gqa_fp8_domain(layout, kv_dtype, q_dtype, group, config_name):
    """FP8 KV through the converting producer (fp16 stages, q scaled by K's descale): every
    draft length to the tile, several splits and one, non-unit scales, both index dtypes."""
    module = kgen.load(layout, kv_dtype, q_dtype)
    check_domain(module, layout, group, ALL_CONFIGS[config_name], q_dtype, kv_dtype,
                 f"fp8/{layout}/{q_dtype}/{group}/{config_name}", domain_index_dtypes(group, _groups(layout)),
                 k_scale=0.75, v_scale=1.25)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gluon_gqa_v_pool_with_its_own_strides(layout):
    """V's pool a view of a wider buffer (its slot stride differs from K's): the producer
    offsets V's rows with V's strides."""
    module = kgen.load(layout, "bfloat16")
    config = gluon_config(module, GLUON_CONFIGS["n64s2"])
    group = SPECS[layout].attention.group_sizes[0]
    problem = make_case(SPECS[layout], [900, 0, 333, 64], [4, 1, 3, 2], group, device="cuda", seed=7)
    poison_unnamed_slots(problem)
    reference = problem.reference(torch.float64)
    v = problem.v_buffer
    wide = torch.full((*v.shape[:-1], v.shape[-1] + 64), float("nan"), dtype=v.dtype, device="cuda")
    wide[..., : v.shape[-1]].copy_(v)
    problem.v_buffer = wide[..., : v.shape[-1]]
    assert problem.v_buffer.stride(0) != problem.k_buffer.stride(0)
    _assert_gluon(module, config, group, 4, problem.max_len_extend)
    problem.o.fill_(float("nan"))
    module.launch(*problem.launch_args(), config=config)
    err = relative_error(problem.o, reference)
    assert err <= tolerance(problem), f"relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gluon_gqa_batch_invariant(layout):
    """The batch-invariant module's Gluon programs (fitted for its DRAFT_ROWS): within tolerance,
    and a request's output bitwise the same alone and in a batch."""
    module = kgen.load(layout, "bfloat16", batch_invariant=True)
    config = gluon_config(module, GLUON_CONFIGS["n64s2"])
    group = max(SPECS[layout].attention.group_sizes)
    prefixes, drafts = [900, 0, 333, 2100], [4, 1, 3, 2]
    problem = make_case(SPECS[layout], prefixes, drafts, group, device="cuda", seed=11)
    poison_unnamed_slots(problem)
    _assert_gluon(module, config, group, 4, problem.max_len_extend)
    module.launch(*problem.launch_args(), config=config)
    err = relative_error(problem.o, problem.reference(torch.float64))
    assert err <= tolerance(problem), f"relative error {err:.2e}"
    alone = make_case(SPECS[layout], prefixes[-1:], drafts[-1:], group, device="cuda", seed=11)
    alone.q.copy_(problem.q[-drafts[-1]:])
    alone.k_extend.copy_(problem.k_extend[-drafts[-1]:])
    alone.v_extend.copy_(problem.v_extend[-drafts[-1]:])
    alone.k_buffer, alone.v_buffer = problem.k_buffer, problem.v_buffer
    alone.kv_indices = problem.kv_indices[-prefixes[-1]:].clone()
    module.launch(*alone.launch_args(), config=config)
    assert torch.equal(alone.o, problem.o[-drafts[-1]:]), "the request's output changed with the batch"
