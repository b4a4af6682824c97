"""Layout specs: the shipped ones load, bad ones are refused with file, field and reason."""

from pathlib import Path

import pytest

from kgen.build import build_all
from kgen.errors import SpecError
from kgen.spec import SHIPPED_LAYOUT_DIR, layouts_for_architecture, load_layouts, parse_layout

GOOD = """
name = "{name}"
architectures = ["SomeModelForCausalLM"]
[attention]
kind = "gqa"
nope_dim = 128
pe_dim = 0
v_head_dim = 128
group_sizes = [8]
[dtypes]
kv = ["bf16", "fp8"]
q = ["bfloat16"]
"""


def test_shipped_layouts_cover_the_issue():
    specs = load_layouts()
    qwen = specs["qwen3_5_gqa256"].attention
    assert (qwen.nope_dim, qwen.pe_dim, qwen.group_sizes) == (256, 0, (4, 8, 16))
    mla = specs["mla_absorbed_512_64"].attention
    assert (mla.nope_dim, mla.pe_dim, mla.v_head_dim, mla.v_source) == (512, 64, 512, "k_latent")
    assert specs["gqa128"].attention.group_sizes == (8, 16)
    assert specs["gqa64"].attention.group_sizes == (4, 8)  # 4: Kimi-K3's DSpark draft
    for spec in specs.values():
        assert {"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz"} <= set(spec.dtypes.kv)
        assert "bfloat16" in spec.dtypes.q
    assert [s.name for s in layouts_for_architecture("KimiK3ForCausalLM", specs)] == ["mla_absorbed_512_64"]
    for model in ("MiniMaxM3SparseForConditionalGeneration", "LlamaForCausalLMEagle3"):
        assert [s.name for s in layouts_for_architecture(model, specs)] == ["gqa128"]
    assert len([a for a in specs["qwen3_5_gqa256"].architectures if a.startswith("Qwen3_5")]) == 4


def test_aliases_are_canonicalized():
    spec = parse_layout(GOOD.format(name="ok"), "ok.toml")
    assert spec.dtypes.kv == ("bfloat16", "float8_e4m3fn")


@pytest.mark.parametrize(
    ("edit", "field", "reason"),
    [
        (lambda t: t.replace('kind = "gqa"', 'kind = "gqa"\nheads = 3'), "attention.heads", "unknown key"),
        (lambda t: t.replace('["bf16", "fp8"]', '["bf16", "int4"]'), "dtypes.kv", "unknown KV dtype 'int4'"),
        (lambda t: t.replace("nope_dim = 128", "nope_dim = 0"), "attention.nope_dim", "greater than 0"),
        (lambda t: t.replace("nope_dim = 128", "nope_dim = -64"), "attention.nope_dim", "greater than 0"),
        (lambda t: t.replace("v_head_dim = 128", "v_head_dim = 192"), "attention", "larger than the K width"),
        (lambda t: t.replace("group_sizes = [8]", "group_sizes = [0]"), "attention.group_sizes", "1..256"),
        (lambda t: t.replace("pe_dim = 0", "pe_dim = 64"), "attention", "pe_dim must be 0"),
        (lambda t: t.replace('name = "x"', 'name = "../evil"'), "name", "not a safe identifier"),
        (lambda t: t.replace('name = "x"', 'name = "class"'), "name", "not a safe identifier"),
        (lambda t: t.replace("[dtypes]", "[dtype]"), "dtypes", "required field is missing"),
    ],
)
def test_bad_specs_name_file_field_and_reason(edit, field, reason):
    text = edit(GOOD.format(name="x"))
    with pytest.raises(SpecError) as err:
        parse_layout(text, "layouts/x.toml")
    message = str(err.value)
    assert "layouts/x.toml" in message
    assert f"field '{field}'" in message
    assert reason in message


def test_name_must_match_file():
    with pytest.raises(SpecError, match="must match the file name 'y'"):
        parse_layout(GOOD.format(name="x"), "y.toml")


def test_bad_toml_is_refused():
    with pytest.raises(SpecError, match="bad.toml: not valid TOML"):
        parse_layout("name = ", "bad.toml")


def test_a_bad_spec_writes_nothing(tmp_path: Path):
    layouts = tmp_path / "layouts"
    layouts.mkdir()
    for src in SHIPPED_LAYOUT_DIR.glob("*.toml"):
        (layouts / src.name).write_text(src.read_text())
    (layouts / "broken.toml").write_text(GOOD.format(name="broken").replace("v_head_dim = 128", "v_head_dim = 999"))
    out = tmp_path / "generated"
    with pytest.raises(SpecError, match="broken.toml"):
        build_all(out_dir=out, layout_dir=layouts)
    assert not out.exists() or not any(out.iterdir())


def test_dropping_a_file_adds_a_layout(tmp_path: Path):
    (tmp_path / "mymodel.toml").write_text(GOOD.format(name="mymodel"))
    specs = load_layouts(tmp_path)
    assert list(specs) == ["mymodel"]
    result = build_all(out_dir=tmp_path / "gen", layout_dir=tmp_path)
    names = sorted(Path(p.output_path).name for p in result.plans)
    assert "verify_mymodel__kv_bf16__q_bf16.py" in names
    assert "verify_perhead_mymodel__kv_fp8_e4m3fn__q_bf16.py" in names
