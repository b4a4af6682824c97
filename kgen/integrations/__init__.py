"""One switch per engine: ``kgen.integrations.sglang`` and ``kgen.integrations.vllm`` route
an engine's target verification through kgen's modules, and everything kgen refuses to the
engine's own kernels (README, "Use it in SGLang" / "Use it in vLLM")."""
