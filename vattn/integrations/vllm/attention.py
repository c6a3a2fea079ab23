"""vattn's attention backend for vLLM: the metadata builder maps the
forward's blocks into the slices and plans the batch once; the
implementation runs the worker's kernel on the dense cache for every layer.

CUDA graphs: on CUDA, where vattn serves FlashAttention, the builder
declares ``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE`` (vLLM then
captures whole decode forwards, attention included, and replays them; mixed
batches run with attention outside the graphs). Every build writes its plan
into the builder's persistent buffers (:class:`ForwardPlanner`), so a replay
finds the forward's indices where the capture saw them. On the CPU, with
vattn's host kernel, it declares ``NEVER``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import numpy as np
import torch

from vattn.common.errors import BackendUnavailable
from vattn.kernels import AttentionBatch, AttentionCase, FlashAttentionKernel, Kernel, KernelPlan, TorchFlashKernel
from vattn.kernels.flash_attn import FlashAttentionBuffers
from vattn.kernels.protocol import LayerViews

from . import configuration, runtime
from .configuration import SWITCH, check_kernel
from .flash_attn import VllmFlashAttentionKernel
from .forward_inputs import ForwardInputs, ForwardReader, PaddedBatch
from .worker_cache import WorkerCache

GRAPHS = "UNIFORM_SINGLE_TOKEN_DECODE"  # the AttentionCGSupport member declared where the kernel runs in graphs
NO_GRAPHS = "NEVER"


def cudagraph_support(device_type: str, head_size: int, dtype: torch.dtype | None) -> str:
    """The name of the ``AttentionCGSupport`` member vattn declares for a
    KV cache of ``head_size`` and ``dtype`` on ``device_type``: ``GRAPHS``
    where the kernel it serves there runs in CUDA graphs
    (:attr:`vattn.kernels.Kernel.graphs`: FlashAttention on CUDA), else
    ``NEVER`` (vattn's host kernel; a case no kernel serves, which start-up
    refuses anyway).

    Uniform single-token decodes only: a graph-capture batch reads the
    padding slice's null-block pages, mapped at start-up for a decode
    capture's one token per row and for the longer rows of vLLM's CUDA-graph
    memory profiling, but not for a mixed capture's (vLLM captures those with
    every row as long as the whole batch)."""
    try:
        kernel = configuration.serving_kernel(AttentionCase(device_type, head_size, dtype, dtype))
    except ValueError:
        return NO_GRAPHS
    return GRAPHS if kernel.graphs else NO_GRAPHS


@dataclasses.dataclass
class VAttnMetadata:
    kernel: Kernel  # the worker's attention kernel
    plan: KernelPlan  # the forward's batch as the kernel planned it; its reqids are the requests' slices
    num_tokens: int  # rows of q, k, v and the output the kernel reads and writes (padded in CUDA graphs)
    # each layer's cache as the kernel reads it, by the address of the layer's [2, S, L, H, D] view: made once
    # per cache (the planner's), checked against this plan once per forward
    views: dict[int, LayerViews] = dataclasses.field(default_factory=dict)
    late: LateCopies | None = None  # rows copied after each layer's K/V writes; None: the kernel writes them


@dataclasses.dataclass(frozen=True)
class LateCopies:
    """A forward whose requests hit blocks that the same forward computes
    (several blocks per page: :class:`vattn.integrations.block_placer.SubPageBlockPlacer`):
    each layer writes the new K/V itself, copies the hit rows, then attends.
    ``[n]`` int64 tensors on the cache's device, slices of the group's views."""

    new_slice: torch.Tensor  # [T] the slice of each new token, in the batch's token order
    new_row: torch.Tensor  # [T] its row
    dst_slice: torch.Tensor  # [C] the rows the hit blocks are copied to
    dst_row: torch.Tensor
    src_slice: torch.Tensor  # [C] the rows they are read from, written by this forward
    src_row: torch.Tensor

    @classmethod
    def of(cls, copies: tuple[np.ndarray, ...], reqids: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
           device: torch.device) -> LateCopies:
        query_lens = np.asarray(query_lens, dtype=np.int64)
        starts = np.repeat(seq_lens - query_lens, query_lens)
        rows = starts + np.arange(len(starts)) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
        arrays = (np.repeat(reqids, query_lens), rows, *copies)
        return cls(*(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device) for a in arrays))

    def write_and_copy(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """The layer's new K/V (``[T, H_kv, D]``) into ``kv_cache`` (``[2, S, L, H_kv, D]``), then the hit rows."""
        kv_cache[0][self.new_slice, self.new_row] = key
        kv_cache[1][self.new_slice, self.new_row] = value
        kv_cache[:, self.dst_slice, self.dst_row] = kv_cache[:, self.src_slice, self.src_row]


def graph_splits(vllm_config: Any, kernel: Kernel) -> tuple[int, int]:
    """``(num_splits, up_to_tokens)``: what vLLM's FlashAttention backend
    passes FlashAttention-3 for batches a full CUDA graph may hold (an upper
    bound, so that the graph's split buffers are sized at capture; its
    heuristic, 0, is not graph-safe), and the largest such batch; ``(0, 0)``
    otherwise."""
    compilation = vllm_config.compilation_config
    if not (isinstance(kernel, VllmFlashAttentionKernel) and kernel.fa_version == 3
            and compilation.cudagraph_mode is not None and compilation.cudagraph_mode.has_full_cudagraphs()):
        return 0, 0
    return (vllm_config.attention_config.flash_attn_max_num_splits_for_cuda_graph,
            compilation.max_cudagraph_capture_size or 0)


class ForwardPlanner:
    """One metadata builder's work each forward, apart from vLLM's classes:
    map the forward's blocks into its requests' slices, then plan the batch.
    It reads the forward as :class:`ForwardInputs` (the builder's
    :class:`ForwardReader` makes them), never vLLM's objects.

    With a kernel that runs in CUDA graphs the plan goes into persistent
    buffers (:class:`vattn.kernels.flash_attn.FlashAttentionBuffers`, for
    ``max_num_reqs`` rows and ``max_num_tokens`` tokens, allocated once) and
    reads vLLM's persistent ``query_start_loc`` and ``seq_lens``, so every
    forward's indices lie where a captured graph reads them. Rows vLLM pads
    a graph's batch with read no key (vLLM gives them length 0) and their
    block-table entry is the group's padding slice; padded tokens write
    their K/V into row 0 of the padding slice (vLLM's ``positions`` of padded
    tokens are left from earlier forwards, so positions are vattn's own).

    Per layer :func:`attend` runs only the kernel's call and its cache write
    (:meth:`vattn.kernels.Kernel.run_layer`): the group's layers' views are
    made here once (:meth:`vattn.kernels.Kernel.layer_views`), each new
    token's row in them is part of the plan, and the checks a layer's run
    makes (the caches against the batch, the mapping) run once per forward,
    in :meth:`build`, on the group's first layer (every layer of a group
    maps the same pages at the same positions).
    """

    def __init__(self, cache: WorkerCache, group: int, device: torch.device, max_num_reqs: int,
                 max_num_tokens: int, num_splits: int = 0, split_tokens: int = 0) -> None:
        self.cache, self.group, self.device = cache, group, device
        self.first_reqid = cache.groups[group].placer.first_reqid  # the manager's reqid of the views' row 0
        self.window = cache.groups[group].window  # tokens its layers' queries see; None: every token
        self.num_splits, self.split_tokens = num_splits, split_tokens
        self.buffers: FlashAttentionBuffers | None = None
        self.padding: int | None = None  # the group's padding slice, in its cache views
        if cache.kernel.graphs:
            self.padding = cache.groups[group].padding
            if self.padding is None:
                raise RuntimeError("vattn: the cache has no padding slice for CUDA graphs")
            self.buffers = FlashAttentionBuffers(max_num_reqs, max_num_tokens, device)
        self.views: dict[int, LayerViews] = {}
        self.first_views: LayerViews | None = None  # what build checks each forward
        self.case = cache.case
        try:
            kv_caches = cache.kv_caches()
        except BackendUnavailable:  # a CUDA cache in a torch without CUDA: no views, nothing can attend
            return
        for name in cache.groups[group].layer_names:
            kv = kv_caches[name]
            if kv.dim() == 5:  # [2, S, L, H, D]; a layer without views (none such in vLLM) runs the checked path
                self.views[kv.data_ptr()] = cache.kernel.layer_views(kv[0], kv[1])
        if not self.views:
            return
        self.first_views = next(iter(self.views.values()))
        k_cache = self.first_views.k_cache
        # the plans' case: the cache's geometry too, so that plans hold the new tokens' rows in the views
        self.case = cache.case._replace(slice_stride=k_cache.stride(0), row_stride=k_cache.stride(1))

    @property
    def graphs(self) -> bool:
        """Plans go into persistent buffers (the kernel runs in CUDA graphs)."""
        return self.buffers is not None

    def reader(self, runner: Any) -> ForwardReader:
        """The reader of this planner's group's forwards out of vLLM's ``runner``."""
        return ForwardReader(runner, self.group, graphs=self.graphs)

    def build(self, inputs: ForwardInputs) -> VAttnMetadata:
        """The forward's metadata: its requests' blocks mapped, the batch
        planned once for every layer."""
        cache = self.cache
        reqids = cache.map_forward(self.group, inputs)
        batch = AttentionBatch.of_arrays(reqids, inputs.seq_lens - inputs.query_lens, inputs.query_lens,
                                         device=self.device, cache=cache.manager, first_reqid=self.first_reqid)
        if inputs.padded is None:
            md = VAttnMetadata(cache.kernel, cache.kernel.plan(batch, self.case), batch.num_tokens, self.views)
        else:
            md = self._plan_into(batch, inputs.padded)
        if self.first_views is not None:
            cache.kernel.check_forward(md.plan, self.first_views, self.window)  # the rows its window reads
        late = cache.late_copies(self.group)
        if late is not None:
            md.late = LateCopies.of(late, reqids, inputs.seq_lens, inputs.query_lens, self.device)
        return md

    def build_for_capture(self, padded: PaddedBatch, longest_seq_len: int) -> VAttnMetadata:
        """The metadata of a batch vLLM captures a graph with (or replays one
        for without requests), whose longest row reads ``longest_seq_len``
        tokens: every row reads and writes the padding slice's first page,
        already mapped, so nothing is mapped, unmapped or allocated; the
        input batch's requests, if any, are not this batch's."""
        if longest_seq_len > self.cache.padding_tokens:
            raise RuntimeError(f"vattn: a CUDA graph capture batch reads {longest_seq_len} tokens per row; the "
                               f"padding slice it reads maps {self.cache.padding_tokens} (sized at start-up for "
                               f"the longest capture batch vLLM 0.32 builds)")
        return self._plan_into(None, padded)

    def _plan_into(self, batch: AttentionBatch | None, padded: PaddedBatch) -> VAttnMetadata:
        kernel = self.cache.kernel
        assert isinstance(kernel, (FlashAttentionKernel, TorchFlashKernel)) and self.buffers is not None
        num_tokens = padded.num_tokens
        arguments = dict(num_rows=padded.num_rows, num_tokens=num_tokens, padding_reqid=self.padding,
                         cu_seqlens_q=padded.query_start_loc, seqused_k=padded.seq_lens,
                         max_seqlen_q=padded.max_query_len, max_seqlen_k=padded.max_seq_len,
                         rows_per_slice=self.first_views.rows_per_slice if self.first_views else 0)
        if isinstance(kernel, FlashAttentionKernel):
            arguments["num_splits"] = self.num_splits if num_tokens <= self.split_tokens else 0
        plan = kernel.plan_into(self.buffers, batch, **arguments)
        return VAttnMetadata(kernel, plan, num_tokens, self.views)


def capture_metadata(planner: ForwardPlanner, reader: ForwardReader, m: Any) -> VAttnMetadata:
    """What the builder returns for a graph-capture batch ``m`` (vLLM's
    ``CommonAttentionMetadata``): the planner's capture plan where the
    kernel runs in graphs, else an ordinary forward's."""
    if not planner.graphs:
        return planner.build(reader.read(m))
    return planner.build_for_capture(reader.padded(m), reader.longest_seq_len(m))


def attend(md: VAttnMetadata, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
           output: torch.Tensor, scale: float, sliding_window: int | None = None,
           logits_soft_cap: float | None = None) -> None:
    """One layer's attention of the forward ``md`` plans: the new tokens' K/V
    (``key``, ``value``: ``[>= T, H_kv, D]``) written into the layer's
    ``[2, S, L, H_kv, D]`` cache ``kv_cache`` and the result of ``query``
    written into ``output`` (``[>= T, H_q, D]``; rows past ``md.num_tokens``,
    a CUDA graph's padding, are not the batch's). Once per layer per forward:
    the kernel's call and its cache write (:meth:`vattn.kernels.Kernel.run_layer`
    on the views the planner made of ``kv_cache``), no check (the kernel's
    limits were checked at start-up, the forward by the planner's build);
    views of ``query`` and the rest are made only where rows are padding. A
    ``kv_cache`` the planner has no views of runs the kernel's checked
    :meth:`vattn.kernels.Kernel.run`. Under CUDA graph capture this runs once
    and is replayed, reading only the plan's persistent tensors."""
    t = md.num_tokens
    out = output
    if t != query.shape[0]:
        query, key, value, out = query[:t], key[:t], value[:t], output[:t]
    if md.late is not None:  # hits on rows this forward writes: written and copied here, before attending
        md.late.write_and_copy(kv_cache, key, value)
        key = value = None
    views = md.views.get(kv_cache.data_ptr())
    if views is None:
        k_cache, v_cache = kv_cache.unbind(0)
        md.kernel.run(md.plan, query, k_cache, v_cache, key, value, out=out, softmax_scale=scale,
                      sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        return
    md.kernel.run_layer(md.plan, views, query, key, value, out, scale, sliding_window, logits_soft_cap)


def _builder_cls() -> type:
    from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder

    class VAttnMetadataBuilder(AttentionMetadataBuilder[VAttnMetadata]):
        """Maps the forward's blocks into the rows' slices, then plans the batch
        once for every layer (the kernel's plan); :class:`ForwardPlanner`."""

        @classmethod
        def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> Any:
            # asked before the cache exists: from the kernel vattn serves on this platform
            return AttentionCGSupport[cudagraph_support(runtime.platform_device(), kv_cache_spec.head_size,
                                                        kv_cache_spec.dtype)]

        def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
            # vLLM declares the builder's __init__ abstract
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            self.planner: ForwardPlanner | None = None  # made when the worker binds the cache
            self.reader: ForwardReader | None = None  # reads the forwards out of the worker's model runner

        def bind(self, cache: WorkerCache, runner: Any) -> None:
            """The worker's cache and model runner: vLLM makes the builders before the KV cache tensors."""
            scheduler = self.vllm_config.scheduler_config
            self.planner = ForwardPlanner(cache, cache.group_of[self.layer_names[0]], self.device,
                                          scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                                          *graph_splits(self.vllm_config, cache.kernel))
            self.reader = self.planner.reader(runner)

        def _bound(self) -> tuple[ForwardPlanner, ForwardReader]:
            if self.planner is None or self.reader is None:
                raise RuntimeError("vattn: attention metadata built before the vattn KV cache exists")
            return self.planner, self.reader

        def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> VAttnMetadata:
            planner, reader = self._bound()
            return planner.build(reader.read(common_attn_metadata))

        def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> VAttnMetadata:
            return capture_metadata(*self._bound(), common_attn_metadata)

    return VAttnMetadataBuilder


def _impl_cls() -> type:
    from vllm.v1.attention.backend import AttentionImpl, AttentionType

    class VAttnAttentionImpl(AttentionImpl):
        """Writes the new K/V into the request's slice and attends over ``k[reqid, :seq_len]``."""

        def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                     alibi_slopes: Any, sliding_window: int | None, kv_cache_dtype: str,
                     logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                     kv_sharing_target_layer_name: str | None = None, sinks: Any = None, **_: Any) -> None:
            unsupported = {
                "ALiBi": alibi_slopes is not None, "attention sinks": sinks is not None,
                f"attention type {str(getattr(attn_type, 'value', attn_type))!r} (decoder only)":
                    attn_type != AttentionType.DECODER,
                "KV sharing across layers": kv_sharing_target_layer_name is not None,
                f"kv_cache_dtype {kv_cache_dtype!r}": kv_cache_dtype not in ("auto", None),
            }
            refused = [name for name, present in unsupported.items() if present]
            if refused:
                raise ValueError(f"vattn's vLLM attention does not support {', '.join(refused)}; "
                                 f"unset {SWITCH} for this model")
            device = "cpu" if not torch.cuda.is_available() else "cuda"
            check_kernel(head_size, device, sliding_window, logits_soft_cap)
            self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
            self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
            self.kv_sharing_target_layer_name = None
            self.attn_type = attn_type

        def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, attn_metadata: VAttnMetadata | None, output: torch.Tensor,
                    output_scale: Any = None, output_block_scale: Any = None) -> torch.Tensor:
            if attn_metadata is None:  # profiling run: no cache yet
                return output
            attend(attn_metadata, query, key, value, kv_cache, output, self.scale, self.sliding_window,
                   self.logits_soft_cap)
            return output

    return VAttnAttentionImpl


def _backend_cls() -> type:
    from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf

    class VAttnAttentionBackend(AttentionBackend):
        forward_includes_kv_cache_update: ClassVar[bool] = True
        supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
        supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

        @staticmethod
        def get_name() -> str:
            return "CPU_ATTN" if not torch.cuda.is_available() else "CUSTOM"

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
            return [MultipleOf(1)]  # the kernel never sees blocks

        @classmethod
        def supports_attn_type(cls, attn_type: str) -> bool:
            return attn_type == AttentionType.DECODER

        @staticmethod
        def get_impl_cls() -> type:
            return _impl_cls_cached()

        @staticmethod
        def get_builder_cls() -> type:
            return _builder_cls_cached()

    return VAttnAttentionBackend


_impl_cls_cached = functools.cache(_impl_cls)
_builder_cls_cached = functools.cache(_builder_cls)
backend_class = functools.cache(_backend_cls)
BACKEND_PATH = f"{__name__}.VAttnAttentionBackend"  # what vLLM's backend registry imports


def __getattr__(name: str) -> Any:
    # The backend class derives from vLLM's, so it is built on first use; vLLM
    # imports it by BACKEND_PATH.
    if name == "VAttnAttentionBackend":
        return backend_class()
    raise AttributeError(name)
