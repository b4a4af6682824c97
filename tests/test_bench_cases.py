"""kgen bench: the case matrix, option parsing and the minimum byte counts (no torch)."""

from __future__ import annotations

import pytest

from kgen.bench.cases import (
    DEFAULT_LAYOUT_GROUPS,
    HEADLINE_SHAPES,
    BenchUsageError,
    build_matrix,
    case_for,
    format_case_list,
    input_sets,
    min_bytes,
    parse_kv_dtypes,
    parse_layout_groups,
    parse_size,
    parse_sizes,
)
from kgen.spec import load_layouts

SPECS = load_layouts()


def test_full_matrix_is_the_issue_matrix() -> None:
    cases = build_matrix(SPECS)
    # 4 layout/group pairs x 2 KV dtypes x 4 batches x 4 prefixes x 3 draft lengths
    assert len(cases) == 4 * 2 * 4 * 4 * 3 == 384
    assert len({c.key for c in cases}) == len(cases)
    assert {(c.layout, c.group) for c in cases} == set(DEFAULT_LAYOUT_GROUPS)
    assert {c.kv_dtype for c in cases} == {"bfloat16", "float8_e4m3fn"}
    assert {c.batch for c in cases} == {1, 16, 64, 128}
    assert {c.prefix for c in cases} == {1024, 4096, 16384, 32768}
    assert {c.draft for c in cases} == {1, 2, 4}


def test_quick_subset_holds_the_headline_cases() -> None:
    quick = build_matrix(SPECS, quick=True)
    assert len(quick) == 32
    full_keys = {c.key for c in build_matrix(SPECS)}
    assert {c.key for c in quick} <= full_keys
    headline = [c for c in quick if c.is_headline]
    # both headline shapes for each of the 4 layout/group pairs and 2 dtypes
    assert len(headline) == len(HEADLINE_SHAPES) * 4 * 2


def test_matrix_order_puts_bf16_before_its_fp8_twin() -> None:
    cases = build_matrix(SPECS, quick=True)
    position = {c.key: i for i, c in enumerate(cases)}
    for c in cases:
        if c.is_fp8:
            twin = [d for d in cases if d.peer_key == c.peer_key and not d.is_fp8]
            assert twin and position[twin[0].key] < position[c.key]


def test_keys_and_peer_keys() -> None:
    bf16 = case_for(SPECS["qwen3_5_gqa256"], 16, "bfloat16", 64, 16384, 4)
    fp8 = case_for(SPECS["qwen3_5_gqa256"], 16, "float8_e4m3fn", 64, 16384, 4)
    assert bf16.key == "qwen3_5_gqa256/g16/bf16/bs64/p16384/L4"
    assert fp8.key == "qwen3_5_gqa256/g16/fp8_e4m3fn/bs64/p16384/L4"
    assert bf16.peer_key == fp8.peer_key == "qwen3_5_gqa256/g16/bs64/p16384/L4"
    assert bf16.is_headline
    two_heads = case_for(SPECS["gqa128"], 8, "bfloat16", 1, 1024, 1, kv_heads=2)
    assert two_heads.key.endswith("/hkv2") and two_heads.num_q_heads == 16


def test_masked_cases_have_their_own_keys_and_read_the_draft_bits() -> None:
    chain = case_for(SPECS["qwen3_5_gqa256"], 16, "bfloat16", 64, 16384, 8)
    tree = case_for(SPECS["qwen3_5_gqa256"], 16, "bfloat16", 64, 16384, 8, mask="tree", mask_ab="none")
    assert not chain.masked and tree.masked
    assert tree.key == chain.key + "/mask-tree" and tree.peer_key == chain.peer_key + "/mask-tree"
    assert min_bytes(tree).mask == 64 * 8 * 8 and min_bytes(chain).mask == 0
    assert min_bytes(tree).total == min_bytes(chain).total + 64 * 8 * 8


def test_parse_masks() -> None:
    from kgen.bench.cases import parse_masks

    assert parse_masks(None) == ("none", None)
    assert parse_masks(["tree,none"]) == ("tree", "none")
    assert parse_masks(["chain"]) == ("chain", None)
    for bad, pattern in ((["forest"], "choose from none, chain, tree"), (["tree,chain,none"], "one or two")):
        with pytest.raises(BenchUsageError, match=pattern):
            parse_masks(bad)


def test_min_bytes_gqa_by_hand() -> None:
    # Qwen3.5 GQA 256, group 16, BF16, 2 requests x 1024 prefix, 4 drafts, 1 KV head:
    #   prefix KV  2 * 1024 * 1 * (256 + 256) * 2 B = 2,097,152
    #   q          (2 * 4) * 16 * 256 * 2 B         =    65,536
    #   draft K/V  (2 * 4) * 1 * (256 + 256) * 2 B  =     8,192
    #   o          (2 * 4) * 16 * 256 * 2 B         =    65,536
    case = case_for(SPECS["qwen3_5_gqa256"], 16, "bfloat16", 2, 1024, 4)
    mb = min_bytes(case)
    assert (mb.prefix_kv, mb.q, mb.draft_kv, mb.o) == (2_097_152, 65_536, 8_192, 65_536)
    assert mb.total == 2_236_416


def test_min_bytes_mla_reads_v_from_k() -> None:
    # Absorbed MLA, FP8 pool, 1 request x 1024 prefix, 2 drafts, group 16: V is K's latent,
    # so the pool is read once at 576 columns of 1 byte.
    #   prefix KV  1024 * 576 * 1 B     = 589,824
    #   q          2 * 16 * 576 * 2 B   =  36,864
    #   draft K    2 * 576 * 2 B        =   2,304
    #   o          2 * 16 * 512 * 2 B   =  32,768
    case = case_for(SPECS["mla_absorbed_512_64"], 16, "float8_e4m3fn", 1, 1024, 2)
    assert not case.separate_v and case.qk_dim == 576 and case.v_dim == 512
    assert min_bytes(case).total == 589_824 + 36_864 + 2_304 + 32_768 == 661_760


def test_min_bytes_fp8_gqa128_headline() -> None:
    case = case_for(SPECS["gqa128"], 8, "float8_e4m3fn", 64, 16384, 4)
    # 64*16384*256*1 + 256*8*128*2 + 256*256*2 + 256*8*128*2
    assert min_bytes(case).total == 268_435_456 + 524_288 + 131_072 + 524_288


def test_input_sets_rotate_past_twice_the_l2() -> None:
    l2 = 50 << 20
    big = case_for(SPECS["mla_absorbed_512_64"], 16, "bfloat16", 128, 32768, 4)
    assert input_sets(big, l2) == 1
    small = case_for(SPECS["gqa128"], 8, "float8_e4m3fn", 1, 1024, 1)
    assert min_bytes(small).total == 266_752
    assert input_sets(small, l2) == 394  # ceil(2 * 52,428,800 / 266,752)
    assert input_sets(small, l2, max_sets=256) == 256
    mid = case_for(SPECS["qwen3_5_gqa256"], 16, "bfloat16", 16, 1024, 4)
    n_mid = input_sets(mid, l2)
    assert n_mid * min_bytes(mid).total >= 2 * l2 > (n_mid - 1) * min_bytes(mid).total


@pytest.mark.parametrize(
    ("text", "value"), [("1024", 1024), ("1K", 1024), ("16k", 16384), (" 32K ", 32768), ("2M", 2 << 20)]
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "K", "1.5K", "-4", "0", "12G"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(BenchUsageError):
        parse_size(text)


def test_parse_sizes_flattens_and_sorts() -> None:
    assert parse_sizes(["16K,1K", "4096"]) == [1024, 4096, 16384]
    assert parse_sizes(None) == []


def test_parse_layout_groups() -> None:
    assert parse_layout_groups(None, SPECS) == list(DEFAULT_LAYOUT_GROUPS)
    assert parse_layout_groups(["qwen3_5_gqa256"], SPECS) == [("qwen3_5_gqa256", 16), ("qwen3_5_gqa256", 4)]
    assert parse_layout_groups(["mla_absorbed_512_64,gqa128:16"], SPECS) == [
        ("mla_absorbed_512_64", 16),
        ("gqa128", 16),
    ]
    assert parse_layout_groups(["gqa64"], SPECS) == [("gqa64", 8)]
    with pytest.raises(BenchUsageError, match="groups"):
        parse_layout_groups(["gqa128:3"], SPECS)
    with pytest.raises(BenchUsageError, match="unknown layout"):
        parse_layout_groups(["llama"], SPECS)


def test_parse_kv_dtypes() -> None:
    assert parse_kv_dtypes(["bf16,fp8"]) == ["bfloat16", "float8_e4m3fn"]
    with pytest.raises(BenchUsageError):
        parse_kv_dtypes(["int4"])


def test_build_matrix_overrides_and_list() -> None:
    cases = build_matrix(SPECS, [("gqa128", 8)], ["bfloat16"], batches=[2], prefixes=[512, 1024], drafts=[3])
    assert [c.key for c in cases] == ["gqa128/g8/bf16/bs2/p512/L3", "gqa128/g8/bf16/bs2/p1024/L3"]
    text = format_case_list(cases)
    assert text.splitlines()[0] == "2 cases" and "gqa128/g8/bf16/bs2/p512/L3" in text
    with pytest.raises(BenchUsageError):
        build_matrix(SPECS, kv_heads=0)
