"""kgen's runtime: the gate (where to start), the chain (what runs), engine adapters.

Start-up: ``sglang_verify_for(...)`` / ``vllm_verify_for(...)`` run the gate once
(``gate_from_env``: device arch, ``KGEN_DISABLE``, ``KGEN_FORCE_PATH``, the generated
modules and tables) and build a ``VerifyChain`` that tries the grouped-head kernel, then
the per-head split-KV kernel, then the general torch path. ``explain_gate`` prints the
decision for ``kgen explain``. See docs/runtime.md.
"""

from kgen.runtime.adapters import (
    SGLangVerify,
    VLLMVerify,
    get_chain,
    sglang_verify_for,
    verify_chain_for,
    vllm_tree_mask,
    vllm_verify_for,
)
from kgen.runtime.attend import GeneralPath, general_verify
from kgen.runtime.call import Features, PagedCall, VerifyCall
from kgen.runtime.chain import VerifyChain
from kgen.runtime.device import arch_from_properties, arch_of, detect_arch
from kgen.runtime.gate import (
    GateDecision,
    GateQuery,
    Inventory,
    Switches,
    decide_path,
    explain_gate,
    gate_from_env,
    scan_inventory,
)

__all__ = [
    "Features",
    "GateDecision",
    "GateQuery",
    "GeneralPath",
    "Inventory",
    "PagedCall",
    "SGLangVerify",
    "Switches",
    "VLLMVerify",
    "VerifyCall",
    "VerifyChain",
    "arch_from_properties",
    "arch_of",
    "decide_path",
    "detect_arch",
    "explain_gate",
    "gate_from_env",
    "general_verify",
    "get_chain",
    "scan_inventory",
    "sglang_verify_for",
    "verify_chain_for",
    "vllm_tree_mask",
    "vllm_verify_for",
]
