"""``kgen.integrations.sglang`` against SGLang 0.5.23's real code, in Triton's interpreter.

The backend tests build a real ``TritonAttnBackend`` (sglang/srt/layers/attention/
triton_backend.py) through the switch, over SGLang's real ``ReqToTokenPool``,
``MHATokenToKVPool``, ``KVIndexTranslator``, ``ForwardBatch`` (TARGET_VERIFY), ``EagleVerifyInput``
and ``RadixAttention``, let it build its own metadata (``init_forward_metadata``, and its
CUDA-graph form ``init_cuda_graph_state`` / ``init_forward_metadata_out_graph``), and run its
real ``forward_extend``. The expected output is the same backend built without the switch on
the same inputs: SGLang's own ``extend_attention_fwd`` (Triton, interpreted too). Only the
test's model runner and model config are stand-ins (plain objects with the fields the backend
reads), as in SGLang's own attention unit-test kit (sglang/test/kits/attention_unittest).

Stubbed or patched, because they cannot run on this CPU machine:

- ``torchvision``: SGLang's model configs import ``torchvision.transforms`` at module level
  (sglang/srt/multimodal/internvl_utils.py via sglang/srt/configs/__init__.py); the PyPI
  wheel is built against CUDA torch (its ``_C`` needs libtorch_cuda.so), so it cannot load
  beside the CPU torch. A stub package answers those imports, installed after
  ``transformers`` is imported so transformers still sees torchvision as absent. Nothing the
  tests run calls into it.
- Triton's interpreter ``InterpreterBuilder.create_dot``: it multiplies bfloat16 operands as
  their raw uint16 bits (Triton 3.6 and 3.9), so SGLang's bf16 kernel
  returns garbage there. The test widens bf16 dot operands to fp32 (exact), which is what the
  GPU's bf16 MMA with fp32 accumulation computes; kgen's modules already pass fp32 operands in
  the interpreter and are unaffected.

Nothing else is stubbed: no SGLang module and no GPU-only package is imported by these paths
on a CPU machine (``sgl_kernel`` only under CUDA). The pure-Python packages SGLang's modules
import come from ``.ci/engines/sglang.txt``.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
from engines import import_engine

from kgen.integrations import sglang as integ
from kgen.plan import module_uri
from kgen.runtime.adapters import SGLangVerify
from kgen.runtime.chain import VerifyChain
from kgen.runtime.gate import Inventory, Switches
from kgen.spec import load_layouts

LAYOUTS = load_layouts()
ATOL = RTOL = 2e-2  # bf16 outputs of two kernels that round differently (the project's bf16 bar)
DTYPE = torch.bfloat16


# ------------------------------------------------------------------ the gate (pure, no SGLang)


def _all_uris() -> frozenset[str]:
    return frozenset(
        module_uri(name, kv, q, variant)
        for name, spec in LAYOUTS.items()
        for kv in spec.dtypes.kv
        for q in spec.dtypes.q
        for variant in ("grouped", "per_head")
    )


INVENTORY = Inventory(layouts=LAYOUTS, available_uris=_all_uris())


def model(
    arch: str, heads: int, kv_heads: int = 1, dims: tuple[int, int, int] = (128, 0, 128), **kw
) -> integ.SGLangModel:
    qk, pe, v = dims
    return integ.SGLangModel(
        model_arch=arch, use_mla=pe > 0, topk=kw.pop("topk", 1), num_q_heads=heads, num_kv_heads=kv_heads,
        qk_dim=qk, pe_dim=pe, v_dim=v, **kw,
    )  # fmt: skip


def decide(m: integ.SGLangModel, arch: str | None = "sm_90", **switches: object) -> integ.SGLangRoute:
    return integ.decide(m, device_arch=arch, inventory=INVENTORY, switches=Switches(**switches))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("m", "layout", "start"),
    [
        # SGLang's own families (triton_backend.py's _should_use_verify_shared_kv, 0.5.23)
        (model("Qwen3_5MoeForCausalLM", 16, dims=(256, 0, 256)), "qwen3_5_gqa256", "grouped"),
        (model("KimiK3ForConditionalGeneration", 16, dims=(576, 64, 512)), "mla_absorbed_512_64", "grouped"),
        # Kimi-K3's linear variant and the DSpark drafts: no kgen layout lists them, their widths decide
        (model("KimiK3LinearForCausalLM", 32, dims=(576, 64, 512)), "mla_absorbed_512_64", "grouped"),
        (model("DSparkDraftModel", 16, 2), "gqa128", "grouped"),
        (model("DSparkMiniMaxDraftModel", 8, 1, dims=(64, 0, 64)), "gqa64", "grouped"),
        # kgen's layout data: MiniMax-M3, EAGLE3 drafts, a tree, several KV heads
        (model("MiniMaxM3SparseForCausalLM", 16, 2), "gqa128", "grouped"),
        (model("LlamaForCausalLMEagle3", 8, 1), "gqa128", "grouped"),
        (model("Qwen3ForCausalLM", 16, 1, topk=4), "gqa128", "grouped"),
        # group 4 is not one of gqa128's (8, 16): the split-KV per-head module starts the chain
        (model("Qwen3ForCausalLM", 8, 2), "gqa128", "per_head"),
        # SGLang's fp8_e5m2 pool holds e5m2 (mem_cache/kv_cache_dtype.py, 0.5.23): kgen's e5m2 modules
        (model("Qwen3ForCausalLM", 8, kv_dtype="float8_e5m2"), "gqa128", "grouped"),
        # a float16 model (an AWQ one, say): its fp16 pool
        (model("Qwen3ForCausalLM", 8, kv_dtype="float16", q_dtype="float16"), "gqa128", "grouped"),
        (model("KimiK3ForConditionalGeneration", 16, dims=(576, 64, 512), kv_dtype="float8_e5m2"),
         "mla_absorbed_512_64", "grouped"),
    ],
)
def test_gate_routes_models_as_sglangs_gate_does_and_more(m, layout, start):
    r = decide(m)
    assert (r.use_kgen, r.layout, r.start) == (True, layout, start), r.reason
    if m.model_arch in ("KimiK3LinearForCausalLM", "DSparkDraftModel", "DSparkMiniMaxDraftModel"):
        assert "SGLang's gate routes" in r.reason and "by its widths" in r.reason
    if m.topk > 1:
        assert "a tree" in r.reason


@pytest.mark.parametrize(
    ("m", "arch", "why"),
    [
        (model("Qwen3ForCausalLM", 8, deterministic=True), "sm_90", "_forward_extend_unified"),
        (model("Qwen3ForCausalLM", 8, dcp_size=2), "sm_90", "_forward_extend_dcp"),
        (model("Qwen3ForCausalLM", 8, skip_prefill=True), "sm_90", "skip_prefill"),
        (model("Qwen3ForCausalLM", 8, sglang_version="0.5.24"), "sm_90", "is not 0.5.23"),
        (model("GPT2LMHeadModel", 8), "sm_90", "no layout lists"),
        (model("DSparkDraftModel", 8, dims=(96, 0, 96)), "sm_90", "no kgen layout has its widths"),
        (model("Qwen3ForCausalLM", 8, kv_dtype="float32", q_dtype="float32"), "sm_90", "not KV"),
        (model("Qwen3ForCausalLM", 8, kv_dtype="float8_e5m2"), "sm_80", "sm_80 has no float8_e5m2"),
        (model("Qwen3ForCausalLM", 8, kv_dtype="float8_e5m2"), "gfx942", "gfx942 has no float8_e5m2"),
        (model("Qwen3ForCausalLM", 8), "sm_75", "not a target"),
        (model("Qwen3ForCausalLM", 8), None, "no GPU"),
        (model("Qwen3ForCausalLM", 6, 4), "sm_90", "not a multiple"),
    ],
)
def test_gate_leaves_sglang_its_own_path(m, arch, why):
    r = decide(m, arch)
    assert not r.use_kgen and r.start is None and why in r.reason, r.reason


def test_gate_reads_kgens_switches():
    qwen = model("Qwen3ForCausalLM", 8)
    assert not decide(qwen, enabled=False).use_kgen
    assert decide(qwen, None, interpreter=True).start == "grouped"
    assert decide(qwen, force_path="per_head").start == "per_head"
    assert not decide(qwen, force_path="general").use_kgen


def test_sglang_families_do_not_override_kgens_layout_data():
    """A family name some layout lists keeps that layout's widths check (no width routing)."""
    inv, note = integ.with_sglang_families(INVENTORY, model("Qwen3_5ForCausalLM", 16, dims=(128, 0, 128)))
    assert inv is INVENTORY and note == ""
    r = decide(model("Qwen3_5ForCausalLM", 16, dims=(128, 0, 128)))
    assert not r.use_kgen and "widths" in r.reason


# ------------------------------------------------- the adapter's part of a call (no host sync)


class _RecordingModule:
    """A kernel level that records its call and accepts it (the module contract)."""

    URI = "recording"

    def __init__(self) -> None:
        self.calls = 0

    def verify_shared_kv_fwd(self, *args: object, **kwargs: object) -> bool:
        self.calls += 1
        return True


_SYNCS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_sync(allow_inside: type | None = None) -> Iterator[None]:
    """Every Tensor method that reads values on the host raises, except inside
    ``allow_inside.__call__`` (the interpreter's kernel launch, which copies its arguments)."""
    saved = {name: getattr(torch.Tensor, name) for name in _SYNCS}
    inside = [0]

    def guard(name: str):
        def method(self, *args, **kwargs):
            if not inside[0]:
                raise AssertionError(f"host sync: Tensor.{name} on the kgen path")
            return saved[name](self, *args, **kwargs)

        return method

    launch = allow_inside.__call__ if allow_inside is not None else None

    def launching(self, *args, **kwargs):
        inside[0] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    try:
        for name in _SYNCS:
            setattr(torch.Tensor, name, guard(name))
        if allow_inside is not None:
            allow_inside.__call__ = launching
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        if allow_inside is not None:
            allow_inside.__call__ = launch


def _flat_call(group: int = 8, d: int = 128) -> tuple[tuple, dict]:
    """SGLang's verify arguments for two requests (prefixes 5 and 9, 3 draft tokens each)."""
    bs, L, hq = 2, 3, group
    q = torch.randn(bs * L, hq, d, dtype=DTYPE)
    k, v = torch.randn(bs * L, 1, d, dtype=DTYPE), torch.randn(bs * L, 1, d, dtype=DTYPE)
    pool = torch.randn(32, 1, d, dtype=DTYPE)
    qo = torch.tensor([0, 3, 6], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 5, 14], dtype=torch.int32)
    kv_indices = torch.arange(1, 15, dtype=torch.int64)
    args = (q, k, v, torch.empty_like(q), pool, pool.clone(), qo, kv_indptr, kv_indices, None, True, None, L, 1.0, 1.0)
    return args, {"sm_scale": d**-0.5, "logit_cap": 0.0, "sliding_window_size": -1, "max_bs": 8}


def test_kgen_verify_does_no_host_sync_and_refuses_without_raising():
    module = _RecordingModule()
    chain = VerifyChain("gqa128", start="grouped", loader=lambda *a: module)
    route = integ.SGLangRoute(True, "grouped", "gqa128", "test")
    verify = integ.KgenVerify(SGLangVerify(chain, defer_general=True), route)
    args, kwargs = _flat_call()
    with no_host_sync(), pytest.raises(AssertionError, match="host sync"):
        bool(args[6][0])  # the guard itself
    with no_host_sync():
        assert verify(*args, **kwargs) is True
    assert module.calls == 1 and chain.last_path == "grouped"
    # kgen's validation rejects it (pool width differs from q's): False for SGLang's kernel, never an error
    bad = (*args[:4], args[4][..., :64], *args[5:])
    assert verify(*bad, **kwargs) is False and "k_buffer" in verify.last_refusal
    assert module.calls == 1


# --------------------------------------------------------------- SGLang's real backend


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of ``root`` and its submodules with empty packages (see the docstring)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name == self.root or name.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubValue(f"{self.__name__}.{name}")


class _StubValue:
    """Whatever SGLang's module-level code takes from torchvision; calling it fails loudly."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubValue(f"{self.name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} is the CPU test's torchvision stub")


def _import_sglang() -> SimpleNamespace:
    import_engine("sglang", "transformers.utils.import_utils")  # first: it records torchvision as absent
    finder = None
    if importlib.util.find_spec("torchvision") is None:
        finder = _StubFinder("torchvision")
        sys.meta_path.insert(0, finder)
    try:
        tb = import_engine("sglang", "sglang.srt.layers.attention.triton_backend")
        from sglang.srt.configs.model_config import AttentionArch
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.runtime_context import get_context, get_parallel
        from sglang.srt.speculative.eagle_info import EagleVerifyInput
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from transformers import PretrainedConfig
    finally:
        if finder is not None:
            sys.meta_path.remove(finder)
    return SimpleNamespace(
        tb=tb, AttentionArch=AttentionArch, RadixAttention=RadixAttention, KVIndexTranslator=KVIndexTranslator,
        MHATokenToKVPool=MHATokenToKVPool, MLATokenToKVPool=MLATokenToKVPool, ReqToTokenPool=ReqToTokenPool,
        CaptureHiddenMode=CaptureHiddenMode, ForwardBatch=ForwardBatch, ForwardMode=ForwardMode,
        get_context=get_context, get_parallel=get_parallel, EagleVerifyInput=EagleVerifyInput,
        SpeculativeAlgorithm=SpeculativeAlgorithm, PretrainedConfig=PretrainedConfig,
    )  # fmt: skip


@pytest.fixture(scope="module")
def sg() -> Iterator[SimpleNamespace]:
    """SGLang's modules, with the interpreter's bf16 dot made exact for the module's tests."""
    env = _import_sglang()
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = _exact_bf16_dot(original, interpreter)
    env.interpreter = interpreter
    try:
        yield env
    finally:
        interpreter.InterpreterBuilder.create_dot = original
        integ.disable()


def _exact_bf16_dot(original, interpreter):
    import numpy as np
    import triton.language as tl

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    return create_dot


@dataclass(frozen=True)
class Setup:
    """One model on one rank, as the test's model runner describes it to the backend. ``mla``:
    absorbed MLA (Kimi-K3's 512 + 64 latent cache, one KV head, V its first 512 columns)."""

    arch: str = "Qwen3ForCausalLM"
    heads: int = 8
    kv_heads: int = 1
    head_dim: int = 128
    topk: int = 1
    draft: int = 3
    window: int | None = None
    context: int = 24
    max_bs: int = 2
    mla: bool = False

    @property
    def dims(self) -> tuple[int, int]:
        """(K width, V width) of the cache and of the layer."""
        return (MLA_RANK + MLA_ROPE, MLA_RANK) if self.mla else (self.head_dim, self.head_dim)


MLA_RANK, MLA_ROPE = 512, 64
KIMI = Setup(arch="KimiK3ForConditionalGeneration", mla=True, head_dim=MLA_ROPE + 128)


class _Config:
    """The model-config fields ``TritonAttnBackend.__init__`` and ``route`` read."""

    def __init__(self, sg: SimpleNamespace, s: Setup) -> None:
        self.attention_arch = sg.AttentionArch.MLA if s.mla else sg.AttentionArch.MHA
        self.kv_lora_rank, self.qk_rope_head_dim = MLA_RANK, MLA_ROPE
        self.context_len = s.context
        self.head_dim = self.v_head_dim = self.swa_v_head_dim = s.head_dim
        self.is_encoder_decoder = False
        self.sliding_window_size = s.window
        self.linear_attn_registry_result = None
        self.hf_config = self.hf_text_config = sg.PretrainedConfig(architectures=[s.arch])
        self._heads, self._kv_heads = s.heads, s.kv_heads

    def get_max_num_attention_heads(self) -> int:
        return self._heads

    def get_num_kv_heads(self, tp_size: int, dcp_size: int = 1) -> int:
        return self._kv_heads


class _Runner:
    """The model-runner fields the backend reads, over SGLang's real pools and index translator."""

    def __init__(self, sg: SimpleNamespace, s: Setup) -> None:
        self.device, self.dtype, self.kv_cache_dtype, self.gpu_id, self.page_size = "cpu", DTYPE, DTYPE, 0, 1
        self.model_config = _Config(sg, s)
        self.is_draft_worker = False
        self.spec_algorithm = sg.SpeculativeAlgorithm.EAGLE
        self.sliding_window_size = s.window
        self.req_to_token_pool = sg.ReqToTokenPool(
            size=s.max_bs, max_context_len=s.context, device="cpu", enable_memory_saver=False
        )
        size = s.max_bs * s.context + 1
        if s.mla:
            self.token_to_kv_pool = sg.MLATokenToKVPool(
                size=size, page_size=1, dtype=DTYPE, kv_lora_rank=MLA_RANK, qk_rope_head_dim=MLA_ROPE, layer_num=1,
                device="cpu", enable_memory_saver=False,
            )  # fmt: skip
        else:
            self.token_to_kv_pool = sg.MHATokenToKVPool(
                size=size, page_size=1, dtype=DTYPE, head_num=s.kv_heads, head_dim=s.head_dim, layer_num=1,
                device="cpu", enable_memory_saver=False, enable_alt_stream=False,
            )  # fmt: skip
        self.token_to_kv_pool_allocator = SimpleNamespace(page_size=1, get_kvcache=lambda: self.token_to_kv_pool)
        self.kv_index_translator = sg.KVIndexTranslator(
            req_to_token=self.req_to_token_pool.req_to_token, token_to_kv_pool=self.token_to_kv_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, page_size=1, device="cpu",
            is_draft_worker=False,
        )  # fmt: skip
        self._draft = s.draft

    def decode_num_tokens_per_req(self, *, num_draft_tokens: int | None = None) -> int:
        return self._draft


@contextlib.contextmanager
def published(sg: SimpleNamespace, s: Setup) -> Iterator[None]:
    """SGLang's process config for EAGLE on one rank (as its own attention test kit publishes it)."""
    override = sg.get_context().override_server_args(
        attention_backend="triton", speculative_algorithm="EAGLE", speculative_eagle_topk=s.topk,
        speculative_num_draft_tokens=s.draft, speculative_num_steps=s.draft - 1, tp_size=1,
        triton_attention_num_kv_splits=8, triton_attention_split_tile_size=None,
        enable_deterministic_inference=False, chunked_prefill_size=-1,
    )  # fmt: skip
    with sg.get_parallel().override(attn_tp_size=1, attn_dcp_rank=0):
        override.install()
        try:
            yield
        finally:
            override.restore()


def backends(sg: SimpleNamespace, s: Setup) -> tuple[object, object, _Runner]:
    """(through the switch, SGLang's own) backends over one runner: the real class, built twice."""
    runner = _Runner(sg, s)
    integ.enable()
    routed = sg.tb.TritonAttnBackend(runner)
    integ.disable()
    own = sg.tb.TritonAttnBackend(runner)
    return routed, own, runner


# An EAGLE tree of 4 draft tokens (topk 2): the root, its two children, a grandchild under the first.
TREE_PARENTS = (-1, 0, 0, 1)


def _draft_block(s: Setup) -> torch.Tensor:
    """Which draft tokens each draft token sees: a chain, or ``TREE_PARENTS``' ancestors."""
    if s.topk == 1:
        return torch.tril(torch.ones(s.draft, s.draft, dtype=torch.bool))
    assert s.draft == len(TREE_PARENTS)
    block = torch.zeros(s.draft, s.draft, dtype=torch.bool)
    for i in range(s.draft):
        j = i
        while j >= 0:
            block[i, j] = True
            j = TREE_PARENTS[j]
    return block


def target_verify_batch(sg: SimpleNamespace, s: Setup, runner: _Runner, prefix: tuple[int, ...], seed: int):
    """A TARGET_VERIFY ForwardBatch with its EagleVerifyInput, slots laid out per request, the
    pool filled with random K/V; the draft tokens' q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    bs, L = len(prefix), s.draft
    for b, p in enumerate(prefix):
        runner.req_to_token_pool.req_to_token[b, : p + L] = torch.arange(p + L) * s.max_bs + b + 1  # interleaved
    pool = runner.token_to_kv_pool
    for buf in (pool.get_key_buffer(0),) if s.mla else (pool.get_key_buffer(0), pool.get_value_buffer(0)):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(DTYPE))
    draft_block = _draft_block(s)
    masks = [torch.cat([torch.ones(L, p, dtype=torch.bool), draft_block], dim=1).reshape(-1) for p in prefix]
    positions = torch.tensor([p + i for p in prefix for i in range(L)], dtype=torch.int64)
    out_loc = torch.cat([runner.req_to_token_pool.req_to_token[b, p : p + L] for b, p in enumerate(prefix)]).long()
    seq_lens = torch.tensor(prefix, dtype=torch.int32)
    fb = sg.ForwardBatch(
        forward_mode=sg.ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=torch.arange(bs * L),
        req_pool_indices=torch.arange(bs, dtype=torch.int32), seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
        out_cache_loc=out_loc, seq_lens_sum=sum(prefix), positions=positions,
    )  # fmt: skip
    runner.kv_index_translator.bind_own_plan(fb)
    fb.spec_info = sg.EagleVerifyInput(
        draft_token=fb.input_ids, custom_mask=torch.cat(masks), positions=positions, retrieve_index=None,
        retrieve_next_token=None, retrieve_next_sibling=None, retrieve_cum_len=None, spec_steps=L - 1,
        topk=s.topk, draft_token_num=L, capture_hidden_mode=sg.CaptureHiddenMode.FULL,
        seq_lens_sum=sum(prefix), seq_lens_cpu=fb.seq_lens_cpu,
    )  # fmt: skip
    d_qk, d_v = s.dims
    q = torch.randn(bs * L, s.heads * d_qk, generator=gen).to(DTYPE)
    k = torch.randn(bs * L, s.kv_heads, d_qk, generator=gen).to(DTYPE)
    # absorbed MLA: the draft's V is its latent, the first columns of its K (as in the cache)
    v = k[..., :d_v].clone() if s.mla else torch.randn(bs * L, s.kv_heads, d_v, generator=gen).to(DTYPE)
    return fb, (q, k, v)


def layer(sg: SimpleNamespace, s: Setup, **kw: object):
    d_qk, d_v = s.dims
    return sg.RadixAttention(s.heads, d_qk, s.head_dim**-0.5, s.kv_heads, layer_id=0, v_head_dim=d_v, **kw)


def run(backend, fb, qkv, lay, **kw) -> torch.Tensor:
    q, k, v = qkv
    return backend.forward_extend(q.clone(), k.clone(), v.clone(), lay, fb, **kw)


def counts(backend) -> dict[str, int]:
    return dict(backend.kgen_verify.chain.counts)


@pytest.mark.parametrize(
    ("setup", "path"),
    [
        (Setup(), "grouped"),  # an EAGLE chain, SGLang's chain-as-mask
        (Setup(topk=2, draft=4), "grouped"),  # an EAGLE tree: the module reads SGLang's mask
        (Setup(heads=4), "per_head"),  # group 4 is not gqa128's: split-KV per head, the seed's second level
        (KIMI, "grouped"),  # Kimi-K3, absorbed MLA: SGLang's own verify_shared_kv family
    ],
    ids=["chain", "tree", "per_head", "kimi_k3_mla"],
)
def test_switch_routes_target_verify_through_kgen(sg, setup, path):
    with published(sg, setup):
        routed, own, runner = backends(sg, setup)
        assert routed.kgen_route.use_kgen and routed.kgen_route.start == path, routed.kgen_route.reason
        assert routed.use_verify_shared_kv and not hasattr(own, "kgen_route") and not own.use_verify_shared_kv
        fb, qkv = target_verify_batch(sg, setup, runner, prefix=(5, 11), seed=1)
        for backend in (routed, own):
            backend.init_forward_metadata(fb)
        before = counts(routed)
        got = run(routed, fb, qkv, layer(sg, setup))
        assert counts(routed)[path] == before[path] + 1  # kgen wrote it, SGLang's kernel did not run
        want = run(own, fb, qkv, layer(sg, setup))
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("feature", ["logit_cap", "sinks", "sliding_window"])
def test_what_kgen_refuses_runs_sglangs_own_kernel(sg, feature):
    """Soft caps, sinks and sliding windows: kgen's modules refuse them, ``forward_extend`` goes
    on to ``extend_attention_fwd``, and the output is SGLang's own, bit for bit."""
    setup = Setup(window=4) if feature == "sliding_window" else Setup()
    lay_kw = {"logit_cap": 5.0} if feature == "logit_cap" else {}
    if feature == "sliding_window":
        lay_kw = {"sliding_window_size": 4}
    call_kw = {"sinks": torch.randn(setup.heads)} if feature == "sinks" else {}
    with published(sg, setup):
        routed, own, runner = backends(sg, setup)
        assert routed.kgen_route.use_kgen, routed.kgen_route.reason
        fb, qkv = target_verify_batch(sg, setup, runner, prefix=(6, 9), seed=2)
        for backend in (routed, own):
            backend.init_forward_metadata(fb)
        before = counts(routed)
        got = run(routed, fb, qkv, layer(sg, setup, **lay_kw), **call_kw)
        assert counts(routed) == before, "a kgen level ran a call it must refuse"
        assert routed.kgen_verify.last_refusal
        want = run(own, fb, qkv, layer(sg, setup, **lay_kw), **call_kw)
    assert torch.equal(got, want)


class _Launches:
    """The interpreter's kernel launches (kernel, grid, every non-tensor argument) while active."""

    def __init__(self, interpreter: types.ModuleType) -> None:
        self.executor = interpreter.GridExecutor
        self.seen: list[tuple] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple]]:
        original = self.executor.__call__
        seen: list[tuple] = []

        def call(executor, *args, **kwargs):
            plain = tuple(a for a in args if not isinstance(a, torch.Tensor))
            plain_kw = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if not isinstance(v, torch.Tensor)))
            seen.append((executor.fn.__name__, repr(executor.grid), repr(plain), plain_kw))
            return original(executor, *args, **kwargs)

        self.executor.__call__ = call
        try:
            yield seen
        finally:
            self.executor.__call__ = original


def _scratch(backend) -> dict:
    module = backend.kgen_verify.chain.levels[0].module
    return {key: tuple(t.data_ptr() for t in bufs) for key, bufs in module.LAUNCHER.scratch.items()}


def test_cuda_graph_metadata_capture_then_replay(sg):
    """SGLang's CUDA-graph path for target verify: preallocated buffers (the whole
    ``cuda_graph_kv_indices``, the uint8 ``VerifyMask`` buffer), filled at capture and refilled in
    place for a replay with other prefixes. kgen's launches are the same at replay as at capture
    (kernels, grids, every host argument), its scratch keeps its address, its part of the call
    does no host sync, and both outputs are SGLang's."""
    setup = Setup()
    with published(sg, setup):
        routed, own, runner = backends(sg, setup)
        for backend in (routed, own):
            backend.init_cuda_graph_state(setup.max_bs, setup.max_bs * setup.draft)
        launches = _Launches(sg.interpreter)
        outputs, plans, scratch = [], [], []
        for step, prefix in enumerate([(5, 11), (13, 2)]):  # capture, then a replay with new values
            fb, qkv = target_verify_batch(sg, setup, runner, prefix=prefix, seed=3 + step)
            for backend in (routed, own):
                backend.init_forward_metadata_out_graph(fb, in_capture=step == 0)
            before = counts(routed)
            verify = routed.verify_shared_kv_fwd
            with launches.recording() as seen, no_host_sync(allow_inside=launches.executor):
                got = run(routed, fb, qkv, layer(sg, setup))
            assert routed.verify_shared_kv_fwd is verify and counts(routed)["grouped"] == before["grouped"] + 1
            plans.append(seen)
            scratch.append(_scratch(routed))
            outputs.append((got, run(own, fb, qkv, layer(sg, setup))))
    assert plans[0] == plans[1] and plans[0], "the launch plan depends on the batch's values"
    assert scratch[0] == scratch[1]
    for got, want in outputs:
        torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


def test_sglangs_plugin_loader_reads_the_switch(sg, monkeypatch):
    """SGLang's own ``load_plugins`` (what its engine, scheduler and detokenizer processes call
    first) finds kgen's entry point; the plugin routes backends only with KGEN_SGLANG=1."""
    from importlib.metadata import entry_points

    from sglang.srt import plugins

    (ep,) = [e for e in entry_points(group=plugins.GENERAL_PLUGINS_GROUP) if e.name == "kgen"]
    assert ep.load() is integ.plugin
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    setup = Setup()
    for switch, routed in (("0", False), ("1", True)):
        integ.disable()
        monkeypatch.setenv(integ.SWITCH_ENV, switch)
        monkeypatch.setattr(plugins, "_plugins_loaded", False)
        plugins.load_plugins()
        assert integ.is_enabled() is routed
        with published(sg, setup):
            backend = sg.tb.TritonAttnBackend(_Runner(sg, setup))
        assert hasattr(backend, "kgen_route") is routed and backend.use_verify_shared_kv is routed
    integ.disable()


def test_route_reads_the_backend_as_sglang_built_it(sg):
    setup = Setup(kv_heads=2, heads=16)
    with published(sg, setup):
        routed, own, runner = backends(sg, setup)
    facts = integ.model_facts(own, runner)
    assert facts == replace(model("Qwen3ForCausalLM", 16, 2), sglang_version=integ.SUPPORTED_VERSION), facts
    assert routed.kgen_route.use_kgen and routed.kgen_route.layout == "gqa128"


def test_a_model_kgen_cannot_read_keeps_sglangs_path(sg, caplog):
    """The hook takes SGLang's keyword call too, and a config kgen cannot read (an MLA config
    without ``kv_lora_rank``) leaves the backend as SGLang built it, with a warning."""
    with published(sg, KIMI):
        runner = _Runner(sg, KIMI)
        integ.enable()
        try:
            assert hasattr(sg.tb.TritonAttnBackend(model_runner=runner), "kgen_route")
            del runner.model_config.kv_lora_rank
            with caplog.at_level("WARNING", logger=integ.__name__):
                backend = sg.tb.TritonAttnBackend(model_runner=runner)
        finally:
            integ.disable()
    assert not hasattr(backend, "kgen_route") and not backend.use_verify_shared_kv
    assert "kv_lora_rank" in caplog.text


def _literal_names(fn) -> set[str]:
    """The architecture names an ``is_*`` predicate of sglang's model_config compares against."""
    return {c for const in fn.__code__.co_consts if isinstance(const, tuple) for c in const if isinstance(c, str)}


def test_families_are_sglangs_own_gate(sg, monkeypatch):
    """``SGLANG_VERIFY_FAMILIES`` is the set SGLang 0.5.23's gate sends to its grouped-head verify
    kernel: the names its predicates hold, each accepted by the real ``_should_use_verify_shared_kv``
    (on gfx950, topk 1, split-KV verify on, one KV head) and nothing else that kgen routes."""
    from sglang.srt.configs import model_config as mc

    names = _literal_names(mc.is_kimi_k3) | _literal_names(mc.is_dspark_draft) | _literal_names(mc.is_qwen3_5)
    assert names == set(integ.SGLANG_VERIFY_FAMILIES)
    monkeypatch.setattr(sg.tb, "is_gfx95_supported", lambda: True)

    def sglang_gate(arch: str, use_mla: bool) -> bool:
        config = SimpleNamespace(hf_config=sg.PretrainedConfig(architectures=[arch]), get_num_kv_heads=lambda *a: 1)
        return sg.tb._should_use_verify_shared_kv(config, 1, use_mla, True)

    with published(sg, Setup()):
        for arch, family in integ.SGLANG_VERIFY_FAMILIES.items():
            assert sglang_gate(arch, use_mla="MLA" in family), arch
        for arch, use_mla in (("Qwen3ForCausalLM", False), ("LlamaForCausalLMEagle3", False),
                              ("DeepseekV3ForCausalLM", True)):  # fmt: skip
            assert not sglang_gate(arch, use_mla), arch  # kgen's layouts route these; SGLang's gate does not
