"""Host side of the Gluon prefix-stage lowerings (kgen/templates/gluon/ for absorbed MLA,
kgen/templates/gluon_gqa/ for GQA, each with its lowering.json): whether one may run in this
process, where it applies, what it compiles with, how it launches.

The launcher asks each of a module's prefix lowerings in turn (``VerifyLauncher.prefix_launch``)
before the Triton prefix stage, which serves every call they do not take.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import triton

from . import rules
from .identity import Kernels, ModuleIdentity
from .launches import GLUON_PREFIX_KERNEL, LaunchSetup
from .switches import env_flag


def gluon_stage_runs(written_for: str) -> bool:
    """True when this Triton is the release the stage is written for (``written_for``.x) and
    KGEN_NO_GLUON is off when the module is imported (an engine's switch; kgen bench runs under
    it to time the Triton chain). Elsewhere the Triton prefix stage serves every call."""
    return triton.__version__.startswith(f"{written_for}.") and not env_flag("KGEN_NO_GLUON")


class GluonPrefixStage:
    """The Gluon prefix stage, absorbed MLA's or GQA's (the module carries one): warp-specialized
    programs of rules.gluon_program_rows rows (a producer warpgroup and two consumer warpgroups),
    for table rows with a gluon section on the stage's arch."""

    kernel_name = GLUON_PREFIX_KERNEL

    @staticmethod
    def draft_rows(identity: ModuleIdentity, max_len: int, block_n: int, group: int,
                   from_rows: int = 0) -> tuple[int, int] | None:
        """(BLOCK_H, L_PAD) of a program for this draft, or None where rules.gluon_refusal gives
        a reason (the draft does not fit, a KV head's rows fall short of from_rows, or a
        batch-invariant module's longest draft exceeds a key tile)."""
        invariant_draft = None if identity.invariance is None else identity.invariance.draft_rows
        if rules.gluon_refusal(identity.kernel_shape, max_len, block_n, group, from_rows, invariant_draft,
                               identity.max_draft_tokens):
            return None
        return rules.gluon_rows(identity.kernel_shape, max_len if invariant_draft is None else invariant_draft,
                                block_n)

    def prefix_launch(self, identity: ModuleIdentity, kernels: Kernels, enabled: bool, arch: str,
                      config: Mapping[str, Any], group: int, max_len: int, page_size: int | None,
                      has_mask: bool, pdl: bool = False) -> tuple[Any, ...] | None:
        """(kernel name, constexprs, compile options, split policy, launched early), or None where
        the Triton kernel serves: the config has no gluon section, the GPU is not the stage's arch,
        this Triton cannot run it, the draft is longer than a key tile or a program's rows, a KV
        head's rows (group x L) fall short of the section's from_rows, or the stages overflow
        shared memory. Both entries (token slots, and block tables: page_size)
        and a custom mask (a tree, or SGLang's chain at topk 1) run in it. ``enabled``: the
        launcher's switch (this Triton runs the stage, KGEN_NO_GLUON off); ``pdl``: the launch
        may start early (programmatic dependent launch; the kernel waits before its first read)."""
        gluon = config.get("gluon")
        if gluon is None or not enabled or arch != identity.gluon_arch:
            return None
        rows = self.draft_rows(identity, max_len, gluon["block_n"], group, gluon.get("from_rows", 0))
        if rows is None:
            return None
        block_h, l_pad = rows
        shape = identity.kernel_shape
        consumers = rules.gluon_consumers(group, l_pad)
        limit = identity.targets[arch]["shared_bytes"]
        landing = rules.gluon_landing_stages(shape, gluon["block_n"], gluon["num_stages"],
                                             gluon.get("landing_stages"), consumers, limit)
        if rules.gluon_shared_bytes(shape, gluon["block_n"], gluon["num_stages"], landing, consumers) > limit:
            return None
        constexprs = {"GROUP": group, "BLOCK_H": block_h, "L_PAD": l_pad, "BLOCK_N": gluon["block_n"],
                      "NUM_STAGES": gluon["num_stages"], "LAZY_RESCALE": bool(gluon.get("lazy_rescale")),
                      "HAS_MASK": has_mask, "BLOCK_TABLE": page_size is not None, "USE_PDL": pdl}
        converters = rules.gluon_converters(shape, consumers, gluon.get("converters"), landing)
        if converters:  # an FP8 GQA program: its converter warpgroups and landing ring are the launch's choice
            constexprs["CONVERTERS"] = converters
            constexprs["LANDING_STAGES"] = landing
        warps = rules.gluon_warps(consumers, converters)
        options = {"num_warps": kernels.gluon_num_warps, "num_stages": 1,
                   "maxnreg": rules.gluon_launch_registers(warps)}
        return self.kernel_name, constexprs, options, {"split": gluon.get("split", {})}, pdl

    @staticmethod
    def launch(kernels: Kernels, grid: tuple[int, ...], setup: LaunchSetup, common: tuple[Any, ...],
               stride_table: int, k_strides: tuple[int, int, int], v_operands: tuple[Any, ...],
               mask_arguments: Mapping[str, Any]) -> None:
        """The Gluon stage's launch: the Triton prefix stage's arguments in the same order, V's
        (v_operands: the V pool, V's draft rows and the pool's strides) where V is its own
        buffer (GQA); absorbed MLA's stage takes none (V is a view of the K stage)."""
        (q, k_pool, k_extend, o, qo_indptr, kv_bounds, kv_table, partial_o, partial_lse, qk_scale, k_scale, v_scale,
         split_ints, prefix_trim_len, draft_lookahead_len) = common
        v_pool, v_extend, v_strides = v_operands or (None, None, ())
        pools = (k_pool, v_pool, k_extend, v_extend) if v_operands else (k_pool, k_extend)
        extend_strides = (k_extend.stride(0), k_extend.stride(1))
        if v_operands:
            extend_strides += (v_extend.stride(0), v_extend.stride(1))
        kernels.gluon_prefix[grid](
            q, *pools, o, qo_indptr, kv_bounds, kv_table, partial_o, partial_lse, qk_scale, k_scale, v_scale,
            *split_ints, setup.page_shift, prefix_trim_len, draft_lookahead_len, stride_table, q.stride(0),
            q.stride(1), *k_strides, *v_strides, *extend_strides, o.stride(0), o.stride(1),
            partial_o.stride(0), partial_o.stride(1), partial_o.stride(2), partial_lse.stride(0), partial_lse.stride(1),
            **mask_arguments, **setup.prefix_constexprs, **setup.prefix_options, **setup.prefix_pdl,
        )
