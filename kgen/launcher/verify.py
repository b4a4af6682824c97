"""The launcher of one generated module: its entry points (SGLang's call, the paged call, their
``why_not``), the block-config lookup and the launch of its two stages.

Everything here depends only on shapes, dtypes, strides and Python scalars: no ``.item()``, no
tensor-to-Python conversion, so a launch is CUDA-graph safe. ``VerifyLauncher`` is the default
mode; ``InvariantVerifyLauncher`` the batch-invariant one (fixed-size splits, their scratch
slots, row blocks of L_PAD rows and a fixed merge chunk).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
import triton

from . import rules
from .cluster import launch_in_clusters, triton_launches_clusters
from .device import INTERPRETER, capturing, device_info, stream_key
from .entries import CallShapes
from .gluon import GluonPrefixStage
from .identity import Kernels, ModuleIdentity
from .launches import (
    GLUON_PREFIX_KERNEL,
    NO_MASK,
    PREFIX_KERNEL,
    LaunchSetup,
    backend_knobs,
    pdl_options,
)
from .pdl import HAS_GRID_DEPENDENCY_CONTROL, pdl_applies
from .switches import env_flag

LOG2E = 1.4426950408889634
# The interpreter plays this target, so that CPU runs take the row blocking the H200 takes.
INTERPRETER_TARGET = "sm_90"
BlockConfigs = Mapping[str, Any]  # arch -> ((group, batch_min, batch_max, config), ...)


class VerifyLauncher(CallShapes):
    """Host side of one generated module (see the package docstring)."""

    invariant = False

    def __init__(self, identity: ModuleIdentity, kernels: Kernels, block_configs: BlockConfigs,
                 default_config: Mapping[str, Any]) -> None:
        self.identity = identity
        self.kernels = kernels
        self.block_configs = block_configs
        self.default_config = default_config
        # Read when the module is imported (an engine's switches): KGEN_NO_PDL turns
        # programmatic dependent launch off, KGEN_CHECK_INDICES checks index values every call.
        # Triton is asked whether it interprets, not TRITON_INTERPRET parsed: its knob is what
        # @triton.jit decided with (kgen/launcher/switches.py says why).
        self.interpret = bool(triton.knobs.runtime.interpret)
        self.no_pdl = env_flag("KGEN_NO_PDL")
        # KGEN_NO_CLUSTER_MERGE: every call's splits merge in the merge stage's launch.
        self.no_cluster_merge = env_flag("KGEN_NO_CLUSTER_MERGE")
        self.cluster_launch = triton_launches_clusters()
        self.check_indices = env_flag("KGEN_CHECK_INDICES")
        self.grid_dependency_control = HAS_GRID_DEPENDENCY_CONTROL
        self.gluon_enabled = kernels.gluon_prefix is not None
        # The prefix stage's other lowerings (packages: kgen/templates/<folder>/ and their host side
        # here), by kernel name, tried before the Triton prefix stage.
        self.prefix_lowerings = {GLUON_PREFIX_KERNEL: GluonPrefixStage()} if identity.gluon_arch else {}
        self.device_info = device_info
        # Scratch (by stream) and FP8 device scales, cached so that graph replays see one address.
        self.scratch: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.device_scales: dict[tuple[float, str], torch.Tensor] = {}
        self.cached_setup = functools.lru_cache(maxsize=4096)(self._table_setup)

    # ---- block configs --------------------------------------------------------------------

    def select_config(self, arch: str, group_size: int, batch: int) -> Mapping[str, Any]:
        """The block config for an arch, group size and batch (table row, else the default)."""
        for group, batch_min, batch_max, config in self.block_configs.get(arch, ()):
            if group == group_size and batch_min <= batch <= batch_max:
                return config
        return self.default_config

    def replace_block_configs(self, block_configs: BlockConfigs) -> None:
        """Put other table rows in place (kgen.load's KGEN_TABLES_DIR / KGEN_TABLE) and forget
        the launches set up from the old ones."""
        self.block_configs = block_configs
        self.cached_setup.cache_clear()

    @property
    def checked_archs(self) -> tuple[str, ...]:
        return tuple(self.identity.targets)

    # ---- launch set-up ----------------------------------------------------------------------

    def target_of(self, arch: str) -> Mapping[str, Any]:
        return self.identity.targets[INTERPRETER_TARGET if arch == INTERPRETER else arch]

    def use_pdl(self, arch: str, is_rocm: bool) -> bool:
        """PDL where the arch has it (pdl.pdl_applies), not under the interpreter or KGEN_NO_PDL."""
        return (self.grid_dependency_control and not self.interpret and not self.no_pdl
                and pdl_applies(arch, is_rocm))

    def cluster_splits(self, arch: str, prefix_kernel: str, max_splits: int, split_config: Mapping[str, Any]) -> int:
        """Splits of a head block the Triton prefix stage launches as one thread-block cluster and
        merges in it (1: the merge stage's launch does). Where the split policy's merge is
        "cluster", the target has clusters and the grid has 2 to a cluster's limit of splits; rounded
        down to a power of two (a program takes one column slice of the merge). Not under the
        interpreter (no clusters), KGEN_NO_CLUSTER_MERGE, the batch-invariant mode or the Gluon stage."""
        if (self.invariant or self.interpret or self.no_cluster_merge or not self.cluster_launch
                or prefix_kernel != PREFIX_KERNEL or not 2 <= max_splits <= self.target_of(arch).get("clusters", 1)):
            return 1
        if (split_config.get("split") or {}).get("merge") != "cluster":
            return 1
        return 1 << (max_splits.bit_length() - 1)

    def draft_first(self, config: Mapping[str, Any], rows: int) -> bool:
        """Whether the last split runs its draft tile before the prefix loop: the config's
        draft_tile ("first" / "after", a tuner axis), else the module's row rule."""
        placement = config.get("draft_tile")
        if placement is None:
            return rows in self.identity.draft_first_rows
        return placement == "first"

    def fitted_draft(self, max_len: int) -> int:
        """The draft length a program is fitted for: the call's own."""
        return max_len

    def triton_prefix(self, arch: str, config: Mapping[str, Any], group: int, max_len: int,
                      page_size: int | None, has_mask: bool) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The Triton prefix stage's (constexprs, compile options), or None when no program fits."""
        is_rocm = self.target_of(arch)["family"] == "hip"
        fitted = rules.fit_program(self.target_of(arch), self.identity.kernel_shape, config, group,
                                   self.fitted_draft(max_len), grouped=self.identity.grouped)
        if fitted is None:
            return None
        block_h, l_pad, block_n = fitted.block_h, fitted.l_pad, fitted.block_n
        constexprs = {"GROUP": group, "BLOCK_H": block_h, "L_PAD": l_pad,
                      "DRAFT_N": rules.draft_tile_columns(block_h * l_pad, l_pad, block_n)}
        if not self.invariant:
            constexprs["ROW_BLOCKS"] = rules.draft_row_blocks(l_pad, max_len)
        constexprs.update(HAS_MASK=has_mask, BLOCK_N=block_n, BLOCK_TABLE=page_size is not None,
                          LAZY_RESCALE=bool(config.get("lazy_rescale")))
        if self.identity.draft_first_rows is not None:
            constexprs["DRAFT_FIRST"] = self.draft_first(config, block_h * l_pad)
        constexprs["USE_PDL"] = self.use_pdl(arch, is_rocm)
        return constexprs, {"num_warps": fitted.num_warps, "num_stages": fitted.num_stages,
                            **backend_knobs(config, is_rocm)}

    def prefix_launch(self, arch: str, config: Mapping[str, Any], group: int, max_len: int,
                      page_size: int | None, has_mask: bool) -> tuple[Any, ...] | None:
        """(kernel name, constexprs, compile options, config of its split policy, launched early)
        of the prefix stage: the first of the module's other lowerings that applies (the Gluon
        stage), else the Triton one; None when no program fits."""
        pdl = self.use_pdl(arch, self.target_of(arch)["family"] == "hip")
        for lowering in self.prefix_lowerings.values():
            chosen = lowering.prefix_launch(self.identity, self.kernels, self.gluon_enabled, arch, config, group,
                                            max_len, page_size, has_mask, pdl)
            if chosen is not None:
                return chosen
        triton_prefix = self.triton_prefix(arch, config, group, max_len, page_size, has_mask)
        if triton_prefix is None:
            return None
        return (PREFIX_KERNEL, *triton_prefix, config, pdl)

    def max_splits(self, config: Mapping[str, Any], programs_per_split: int, num_sms: int) -> tuple[int, int]:
        """(grid size of the split axis, min tokens a split): enough programs to fill the GPU."""
        split = {**self.identity.split_defaults, **config.get("split", {})}
        # Rounded down: a grid just past a whole wave leaves most SMs idle for the last one.
        wanted = (split["programs_per_sm"] * num_sms) // programs_per_split
        return max(1, min(wanted, split["max_splits"])), split["min_tokens_per_split"]

    def merge_heads(self, l_pad: int) -> int:
        """Query heads per merge program: merge_rows rows (a power of two, for tl.arange); heads
        past the last one are masked."""
        return max(1, self.identity.merge_rows // l_pad)

    def split_setup(self, prefix: Mapping[str, Any], split_config: Mapping[str, Any], head_blocks: int,
                    batch: int, max_len: int, num_sms: int, num_kv_heads: int) -> dict[str, Any]:
        """The split axis: every KV head's head blocks (and draft row blocks) of every request are
        programs of one split, and the split axis fills what they leave of the GPU. The merge
        takes every draft row of a head at once (rows of all row blocks)."""
        row_blocks = prefix.get("ROW_BLOCKS", 1)
        max_splits, min_tokens = self.max_splits(split_config, num_kv_heads * head_blocks * row_blocks * batch,
                                                 num_sms)
        return {"row_blocks": row_blocks, "max_splits": max_splits, "split_tokens": min_tokens,
                "merge_l_pad": rules.next_pow2(max(prefix["L_PAD"], max_len)),
                "split_chunk": min(rules.next_pow2(max_splits), self.identity.merge_split_chunk),
                "needs_merge": max_splits > 1}

    def launch_setup(self, arch: str, num_sms: int, group: int, batch: int, max_len: int, page_size: int | None,
                     config: Mapping[str, Any] | None, num_kv_heads: int = 1, has_mask: bool = False,
                     clusters: bool = True) -> LaunchSetup | None:
        """Everything one call launches, from Python scalars alone (None when no program fits).
        ``clusters`` False: never the merge in a cluster (a device that cannot hold the clusters)."""
        is_rocm = self.target_of(arch)["family"] == "hip"
        config = config if config is not None else self.select_config(arch, group, batch)
        use_pdl = self.use_pdl(arch, is_rocm)
        chosen = self.prefix_launch(arch, config, group, max_len, page_size, has_mask)
        if chosen is None:
            return None
        prefix_kernel, prefix, prefix_options, split_config, prefix_pdl = chosen
        head_blocks = rules.cdiv(group, prefix["BLOCK_H"])
        splits = self.split_setup(prefix, split_config, head_blocks, batch, max_len, num_sms, num_kv_heads)
        cluster = self.cluster_splits(arch, prefix_kernel, splits["max_splits"], split_config) if clusters else 1
        if prefix_kernel == PREFIX_KERNEL and not self.invariant:
            prefix = {**prefix, "CLUSTER_SPLITS": cluster,
                      "CLUSTER_MERGE_STAGES": rules.cluster_merge_stages(split_config.get("split") or {}, cluster)}
        if cluster > 1:
            splits.update(max_splits=cluster, needs_merge=False)
        merge_heads = self.merge_heads(splits["merge_l_pad"])
        merge_stages = rules.merge_split_stages(self.target_of(arch), merge_heads * splits["merge_l_pad"],
                                                self.identity.merge_block_dv, splits["split_chunk"],
                                                splits["max_splits"])
        merge_constexprs = {"MERGE_HEADS": merge_heads, "L_PAD": splits["merge_l_pad"],
                            "SPLIT_CHUNK": splits["split_chunk"], "SPLIT_STAGES": merge_stages,
                            "BLOCK_TABLE": page_size is not None, "USE_PDL": use_pdl}
        merge_options = {"num_warps": 4, "num_stages": 2, **backend_knobs(config, is_rocm)}
        return LaunchSetup(
            head_blocks=head_blocks, row_blocks=splits["row_blocks"], max_splits=splits["max_splits"],
            split_tokens=splits["split_tokens"], block_n=prefix["BLOCK_N"],
            page_shift=(page_size or 1).bit_length() - 1, prefix_kernel=prefix_kernel,
            prefix_constexprs=prefix, prefix_options=prefix_options, prefix_pdl=pdl_options(prefix_pdl),
            merge=(merge_constexprs, merge_options) if splits["needs_merge"] else None,
            merge_pdl=pdl_options(use_pdl))

    def _table_setup(self, arch: str, num_sms: int, group: int, batch: int, max_len: int, page_size: int | None,
                     num_kv_heads: int = 1, has_mask: bool = False, clusters: bool = True) -> LaunchSetup | None:
        """launch_setup with the module's own configs (cached_setup caches it: the same shapes
        every step)."""
        return self.launch_setup(arch, num_sms, group, batch, max_len, page_size, None, num_kv_heads, has_mask,
                                 clusters)

    def setup_for(self, arch: str, num_sms: int, group: int, batch: int, max_len: int, page_size: int | None,
                  config: Mapping[str, Any] | None, num_kv_heads: int = 1, has_mask: bool = False,
                  clusters: bool = True) -> LaunchSetup | None:
        if config is None:
            return self.cached_setup(arch, num_sms, group, batch, max_len, page_size, num_kv_heads, has_mask,
                                     clusters)
        return self.launch_setup(arch, num_sms, group, batch, max_len, page_size, config, num_kv_heads, has_mask,
                                 clusters)

    def launch_params(self, arch: str, num_sms: int, group: int, batch: int, max_len: int,
                      page_size: int | None = None, config: Mapping[str, Any] | None = None, num_kv_heads: int = 1,
                      has_mask: bool = False) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
        """The kernels one call launches, as (kernel name, constexpr arguments, compile options).

        Pure Python: `kgen check` compiles exactly these offline for each target. page_size None
        is the token-slot entry (verify_shared_kv_fwd), an int the paged entry (verify_paged_fwd);
        has_mask a call with a custom mask (a tree). The merge stage is absent when every
        request's prefix fits one split (the batch-invariant mode lists it always: it runs when
        the call's index table can hold a prefix of more than one split). Returns [] when no
        program fits the target (the entry points refuse such calls)."""
        setup = self.setup_for(arch, num_sms, group, batch, max_len, page_size, config, num_kv_heads, has_mask)
        return [] if setup is None else setup.launches(has_mask)

    # ---- scratch and scales -----------------------------------------------------------------

    def scratch_buffers(self, device: torch.device, rows: int, num_q_heads: int,
                        splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 partials [rows, H_q, splits, D_v] and log2-sum-exp [rows, H_q, splits]. In the
        default mode a row is a q token and a split one of the grid's; batch invariant, a draft
        position and a request's scratch slot.

        Eager calls get them cached by stream and shape: replays see one address, and calls on
        two streams at once never share partials. A CUDA-graph capture gets partials of its own,
        made fresh and never cached: a graph owns them (its capture reuses the memory from one
        call to the next, as it reuses any freed tensor), so two graphs replayed at once on two
        streams do not share them either, and no eager call reads memory only a replay fills."""
        if capturing():
            return self.new_partials(device, rows, num_q_heads, splits)
        key = (str(device), stream_key(device), rows, num_q_heads, splits)
        buffers = self.scratch.get(key)
        if buffers is None:
            buffers = self.scratch[key] = self.new_partials(device, rows, num_q_heads, splits)
        return buffers

    def new_partials(self, device: torch.device, rows: int, num_q_heads: int,
                     splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialized partials and log2-sum-exp of ``scratch_buffers``' shapes."""
        partial_o = torch.empty((rows, num_q_heads, splits, self.identity.v_head_dim), dtype=torch.float32,
                                device=device)  # fmt: skip
        partial_lse = torch.empty((rows, num_q_heads, splits), dtype=torch.float32, device=device)
        return partial_o, partial_lse

    def scratch_bytes(self, num_tokens: int, num_q_heads: int, num_kv_heads: int, batch: int, max_len: int,
                      arch: str, num_sms: int, config: Mapping[str, Any] | None = None) -> int:
        """Bytes of scratch (fp32 partials + log2-sum-exp) the launcher allocates for these shapes:
        once per stream that launches them eagerly, and once in each CUDA graph that captures them."""
        setup = self.launch_setup(arch, num_sms, num_q_heads // num_kv_heads, batch, max_len, None, config,
                                  num_kv_heads)
        return 4 * num_tokens * num_q_heads * setup.max_splits * (self.identity.v_head_dim + 1)

    def device_scale(self, value: float, device: torch.device | str) -> torch.Tensor:
        """A float scale as the 1-element device tensor the kernel reads.

        Cached only when made outside CUDA-graph capture: a tensor made during a capture is
        filled by the graph's replay alone, so an eager call (or another graph) reading it from
        the cache before that replay would read memory nobody wrote. During a capture an uncached
        value gets a fresh tensor whose fill is captured in front of the kernel that reads it."""
        key = (float(value), str(device))
        tensor = self.device_scales.get(key)
        if tensor is None:
            tensor = torch.full((1,), float(value), dtype=torch.float32, device=device)
            if not capturing():
                self.device_scales[key] = tensor
        return tensor

    def kernel_scales(self, k_scale: Any, v_scale: Any, device: torch.device) -> tuple[Any, Any]:
        """(k, v) as the kernel takes them: FP8 modules read 1-element fp32 device tensors (a float,
        or None for 1.0, becomes a cached device scalar); a 16-bit pool's are float arguments."""
        k_scale = 1.0 if k_scale is None else k_scale
        v_scale = 1.0 if v_scale is None else v_scale
        if not self.identity.fp8_kv:
            return float(k_scale), float(v_scale)
        k_scale = k_scale if isinstance(k_scale, torch.Tensor) else self.device_scale(k_scale, device)
        v_scale = v_scale if isinstance(v_scale, torch.Tensor) else self.device_scale(v_scale, device)
        return k_scale, v_scale

    @staticmethod
    def mask_arguments(custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None,
                       paged: bool) -> dict[str, Any]:
        """The prefix stage's mask arguments: the mask's bytes as uint8 (bool and int8 masks are
        the same bytes), its offsets and, for the paged entry's [rows, W] mask, its row stride;
        Nones (NO_MASK) for a call without a mask."""
        if custom_mask is None:
            return NO_MASK
        if paged:
            mask, stride_mask_row = custom_mask.view(torch.uint8), custom_mask.stride(0)
        else:
            mask, stride_mask_row = custom_mask.reshape(-1).view(torch.uint8), 0
        return {"Custom_Mask": mask, "Mask_Indptr": mask_indptr, "stride_mask_row": stride_mask_row}

    # ---- the launch ---------------------------------------------------------------------------

    def run(self, q: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor, o: torch.Tensor,
            k_pool: torch.Tensor, v_pool: torch.Tensor, qo_indptr: torch.Tensor, kv_bounds: torch.Tensor,
            kv_table: torch.Tensor, max_len: int, k_scale: Any, v_scale: Any, sm_scale: float | None,
            config: Mapping[str, Any] | None, page_size: int | None, stride_table: int,
            k_strides: tuple[int, int, int], v_strides: tuple[int, int, int],
            custom_mask: torch.Tensor | None = None, mask_indptr: torch.Tensor | None = None,
            is_causal: bool = True, prefix_trim_len: int = 0) -> None:
        """Launch both stages. is_causal=False without a mask: every draft token sees the whole
        draft block (a runtime draft_lookahead_len, no other program); prefix_trim_len: the last
        slots of each request's kv_indptr slice that are not its prefix (-kv_len_adjust, token
        slots only)."""
        num_tokens, num_q_heads, _ = q.shape
        num_kv_heads = k_extend.shape[1]
        batch = qo_indptr.shape[0] - 1
        if num_tokens == 0 or batch == 0:
            return
        arch, num_sms, _ = self.device_info(q.device.type, q.device.index)
        group = num_q_heads // num_kv_heads
        shapes = (arch, num_sms, group, batch, max_len, page_size, config, num_kv_heads, custom_mask is not None)
        setup = self.setup_for(*shapes)
        if setup is None:
            raise ValueError(f"{self.identity.uri}: no program fits {arch} for group {group}, draft length {max_len}")
        sm_scale = 1.0 / math.sqrt(self.identity.qk_dim) if sm_scale is None else sm_scale
        k_scale, v_scale = self.kernel_scales(k_scale, v_scale, q.device)
        # Columns past its own a draft row sees: none in a chain, every one of a non-causal block.
        draft_lookahead_len = self.identity.max_draft_tokens if custom_mask is None and not is_causal else 0
        mask_arguments = self.mask_arguments(custom_mask, mask_indptr, page_size is not None)
        tensors = (q, k_pool, v_pool, k_extend, v_extend, o, qo_indptr, kv_bounds, kv_table)
        scalars = (sm_scale * LOG2E, k_scale, v_scale, prefix_trim_len, draft_lookahead_len, stride_table,
                   k_strides, v_strides, page_size)
        if not self.launch_stages(setup, tensors, scalars, mask_arguments):
            # Its clusters do not fit this device at once: the same call without them.
            self.launch_stages(self.setup_for(*shapes, clusters=False), tensors, scalars, mask_arguments)

    def launch_stages(self, setup: LaunchSetup, tensors: tuple[torch.Tensor, ...], scalars: tuple[Any, ...],
                      mask_arguments: Mapping[str, Any]) -> bool:
        """Launch the prefix stage and, where the grid has splits it does not merge, the merge
        stage. False, having launched nothing, where the setup's clusters do not fit the device."""
        q, k_pool, v_pool, k_extend, v_extend, o, qo_indptr, kv_bounds, kv_table = tensors
        qk_scale, k_scale, v_scale, prefix_trim_len, draft_lookahead_len, stride_table, k_strides, v_strides, \
            page_size = scalars
        num_q_heads, num_kv_heads, batch = q.shape[1], k_extend.shape[1], qo_indptr.shape[0] - 1
        grid, split_ints, partials, grid_splits = self.grid_and_scratch(setup, q, num_kv_heads, batch, kv_table,
                                                                        page_size)
        common = (q, k_pool, k_extend, o, qo_indptr, kv_bounds, kv_table, *partials, qk_scale,
                  k_scale, v_scale, split_ints, prefix_trim_len, draft_lookahead_len)
        if setup.prefix_kernel in self.prefix_lowerings:
            v_operands = () if self.identity.v_from_k_tile else (v_pool, v_extend, v_strides)
            self.prefix_lowerings[setup.prefix_kernel].launch(self.kernels, grid, setup, common, stride_table,
                                                              k_strides, v_operands, mask_arguments)
        elif not self.launch_triton_prefix(grid, setup, common, v_pool, v_extend, stride_table, k_strides, v_strides,
                                           mask_arguments):
            return False
        if setup.merge is not None and grid_splits > 1:
            self.launch_merge(setup, o, qo_indptr, kv_bounds, partials, num_q_heads, batch, split_ints,
                              prefix_trim_len, stride_table)
        return True

    def grid_and_scratch(self, setup: LaunchSetup, q: torch.Tensor, num_kv_heads: int, batch: int,
                         kv_table: torch.Tensor, page_size: int | None) -> tuple[Any, ...]:
        """(prefix grid, the split plan's ints as both stages take them, (partial_o, partial_lse),
        splits in the grid)."""
        partials = self.scratch_buffers(q.device, q.shape[0], q.shape[1], setup.max_splits)
        # Clustered, the splits are a cluster of consecutive programs on axis 0 (launch_in_clusters).
        splits_axis = 1 if setup.cluster_splits > 1 else setup.max_splits
        grid = (num_kv_heads * setup.head_blocks * setup.row_blocks, splits_axis, batch)
        return grid, (setup.max_splits, setup.split_tokens), partials, setup.max_splits

    def launch_triton_prefix(self, grid: tuple[int, ...], setup: LaunchSetup, common: tuple[Any, ...],
                             v_pool: torch.Tensor, v_extend: torch.Tensor, stride_table: int,
                             k_strides: tuple[int, int, int], v_strides: tuple[int, int, int],
                             mask_arguments: Mapping[str, Any]) -> bool:
        """The Triton prefix stage's launch; False, having launched nothing, where its clusters do
        not fit the device at once."""
        (q, k_pool, k_extend, o, qo_indptr, kv_bounds, kv_table, partial_o, partial_lse, qk_scale, k_scale, v_scale,
         split_ints, prefix_trim_len, draft_lookahead_len) = common
        v_pointer = () if self.identity.v_from_k_tile else (v_pool,)
        v_pool_strides = () if self.identity.v_from_k_tile else v_strides
        args = (q, k_pool, *v_pointer, k_extend, v_extend, o, qo_indptr, kv_bounds, kv_table, partial_o, partial_lse,
                qk_scale, k_scale, v_scale, *split_ints, setup.page_shift, prefix_trim_len, draft_lookahead_len,
                stride_table, q.stride(0), q.stride(1), *k_strides, *v_pool_strides,
                k_extend.stride(0), k_extend.stride(1), v_extend.stride(0), v_extend.stride(1), o.stride(0),
                o.stride(1), partial_o.stride(0), partial_o.stride(1), partial_o.stride(2), partial_lse.stride(0),
                partial_lse.stride(1))
        kwargs = {**mask_arguments,
                  "DOT_DTYPE": triton.language.float32 if self.interpret else self.identity.prefix_dot_dtype,
                  **setup.prefix_constexprs, **setup.prefix_options, **setup.prefix_pdl}
        if setup.cluster_splits > 1:
            return launch_in_clusters(self.kernels.prefix, grid, setup.cluster_splits, args, kwargs)
        self.kernels.prefix[grid](*args, **kwargs)
        return True

    def merge_grid(self, setup: LaunchSetup, num_q_heads: int, batch: int, merge_heads: int) -> tuple[int, ...]:
        return (rules.cdiv(num_q_heads, merge_heads), batch,
                rules.cdiv(self.identity.v_head_dim, self.identity.merge_block_dv))

    def merge_split_args(self, setup: LaunchSetup, split_ints: tuple[int, ...]) -> tuple[int, ...]:
        """The merge stage's split arguments: the split plan's ints and the key tile width."""
        return (*split_ints, setup.block_n)

    def launch_merge(self, setup: LaunchSetup, o: torch.Tensor, qo_indptr: torch.Tensor, kv_bounds: torch.Tensor,
                     partials: tuple[torch.Tensor, torch.Tensor], num_q_heads: int, batch: int,
                     split_ints: tuple[int, ...], prefix_trim_len: int, stride_table: int) -> None:
        partial_o, partial_lse = partials
        merge_constexprs, merge_options = setup.merge
        grid = self.merge_grid(setup, num_q_heads, batch, merge_constexprs["MERGE_HEADS"])
        self.kernels.merge[grid](
            o, qo_indptr, kv_bounds, partial_o, partial_lse, num_q_heads, *self.merge_split_args(setup, split_ints),
            prefix_trim_len, stride_table, o.stride(0), o.stride(1), partial_o.stride(0), partial_o.stride(1),
            partial_o.stride(2), partial_lse.stride(0), partial_lse.stride(1),
            **merge_constexprs, **merge_options, **setup.merge_pdl,
        )
