"""The device-generic copy path between an engine's paged KV and host memory (kvtier's L1 or a received chunk).

Per chunk: one batched gather of all its blocks on the KV's own device (``index_select`` over the block axis of
a canonical view, ``vllm_cuda_layouts.canonical_view``), then one copy to host memory; a load is the reverse (one
copy from host memory, one ``index_copy_``; on CPU a slice copy per run of consecutive blocks, several times faster
than torch's CPU ``index_copy_``). Every CUDA-only line of kvtier is in this module:

* Copies run on a side stream that first waits for the compute stream (the KV the forward pass wrote, the blocks it
  freed). A load records an event after its scatter; ``wait_loaded`` makes the compute stream wait for it on the
  device (the connector calls it when the forward pass reaches its first attention layer), so a loaded block is read
  only once it is there and the work before that overlaps the copy. The host waits on the side stream only, never
  with a device-wide synchronisation.
* Host memory: the shared-memory L1 registered with ``cudaHostRegister`` (``register_host``), so the DMA engine
  reads and writes the L1 slot itself; memory that is not registered (refused, or another buffer) goes through a
  pinned staging buffer from torch's caching host allocator. A load from registered memory waits, on the host, for
  its host-to-device copy (not the scatter) before it returns, unless the caller keeps the memory pinned and waits
  on the returned event itself (``wait_host=False``); from a pinned staging buffer it does not wait. A store waits
  until its copy is done (the L1 slot must be complete before the store commits), which comes after the compute
  stream's work so far: the forward pass that wrote that KV.
* Block ids go to the device in a pinned buffer (``non_blocking``): no ``.tolist()``, ``.numpy()``, ``.item()`` or
  pageable copy of a device tensor anywhere on these paths.

On CPU the same functions run with CPU tensors: the gather writes straight into the host destination.
"""

from __future__ import annotations

import logging

import torch


logger = logging.getLogger("vllm.kvtier_connector")


# the mappings registered with cudaHostRegister in this process, once each whichever copier did it:
# id(mapping) -> (first byte, end)
_REGISTERED: dict[int, tuple[int, int]] = {}


class DeviceCopier:
    """Copies between paged KV on ``device`` and host memory.

    ``host_memory``: a callable giving the shared-memory L1 this process maps (an object with ``address``,
    ``capacity_bytes`` and ``close_hooks``: ``kvtier.client.dataplane.SharedMapping``), or None; on CUDA it is
    registered (``cudaHostRegister``) the first time it is seen, and unregistered before it is unmapped.
    """

    def __init__(self, device, host_memory=None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.host_memory = host_memory
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._loaded: list = []  # CUDA events of scatters the compute stream has not waited for yet
        self._refused = False  # cudaHostRegister refused once: pinned staging from then on
        if self.cuda:
            self.register_host()

    # ---- host memory ------------------------------------------------------------------------------------
    @property
    def registered(self) -> bool:
        """Whether the current shared-memory L1 is registered with CUDA (copies go straight to and from it)."""
        mapping = self.host_memory() if (self.cuda and self.host_memory) else None
        return mapping is not None and id(mapping) in _REGISTERED

    def register_host(self) -> bool:
        """Register the current shared-memory L1 (``host_memory()``) with CUDA if it is new; True when it is
        registered now. A refusal (not allowed here, e.g. a sandbox) is logged once; copies then stage."""
        mapping = self.host_memory() if (self.cuda and self.host_memory) else None
        if mapping is None or self._refused:
            return False
        if id(mapping) in _REGISTERED:
            return True
        address, nbytes = mapping.address, mapping.capacity_bytes
        err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        if int(err) != 0:
            self._refused = True
            logger.warning("kvtier: cudaHostRegister of the shared L1 (%d bytes) was refused (CUDA error %d); KV "
                           "copies go through a pinned staging buffer", nbytes, int(err))
            return False
        _REGISTERED[id(mapping)] = (address, address + nbytes)
        mapping.close_hooks.append(_unregister)
        return True

    def synchronize(self) -> None:
        """Wait, on the host, until every copy issued so far is done (CUDA; nothing to wait for on CPU)."""
        if self.cuda:
            self.stream.synchronize()

    # ---- the two copies ---------------------------------------------------------------------------------
    def gather(self, view: torch.Tensor, dim: int, block_ids, out: torch.Tensor) -> None:
        """``out`` (host, C-contiguous ``(..., n, H, D)``, raw dtype) <- the first ``n`` tokens of ``block_ids`` of
        ``view`` (canonical, block axis ``dim``, then ``ratio, N, H, D``). Mutates ``out``; waits until it is
        written (a store commits it next)."""
        nb = -(-out.shape[-3] // (view.shape[dim + 1] * view.shape[dim + 2]))  # the caller checked block_ids holds them
        if not self.cuda:
            _select(*_as_words(view, out), dim, self._ids(block_ids[:nb]))
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)
            self.register_host()
            staged = torch.empty(_blocks_shape(view, dim, nb), dtype=view.dtype, device=self.device)
            torch.index_select(view, dim, self._ids(block_ids[:nb]), out=staged)
            tokens = staged.flatten(dim, dim + 2)[..., :out.shape[-3], :, :]
            host = out if _is_registered(out) else torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # this copy only (and the compute work it waited for), never the whole device
        if host is not out:
            out.copy_(host)

    def scatter(self, view: torch.Tensor, dim: int, block_ids, src: torch.Tensor, wait_host: bool = True):
        """Write ``src`` (host, ``(..., n, H, D)``, raw dtype, n a whole number of blocks) into ``block_ids`` of
        ``view``. Mutates ``view`` (on CUDA once the side stream gets there: ``wait_loaded`` orders the compute stream
        after it). Returns the CUDA event after which ``src`` has been read (None on CPU); with ``wait_host`` (the
        default) it has been read already when this returns."""
        nb = src.shape[-3] // (view.shape[dim + 1] * view.shape[dim + 2])
        if not self.cuda:  # runs of consecutive blocks as slices: torch's CPU index_copy_ is several times slower
            view, src = _as_words(view, src)
            blocks, done = src.unflatten(-3, (nb, view.shape[dim + 1], view.shape[dim + 2])), 0
            for first, count in _runs(block_ids[:nb]):
                view.narrow(dim, first, count).copy_(blocks.narrow(dim, done, count))
                done += count
            return None
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)
            self.register_host()
            ids = self._ids(block_ids[:nb])
            registered = src.is_contiguous() and _is_registered(src)
            host = src if registered else torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
            staged = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            staged.copy_(host, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
            view.index_copy_(dim, ids, staged.unflatten(-3, (nb, view.shape[dim + 1], view.shape[dim + 2])))
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self._loaded.append(ready)
        if registered and wait_host:  # the caller unpins ``src`` next: the DMA must have read it
            copied.synchronize()
        return copied

    def wait_loaded(self) -> None:
        """Make the compute stream wait, on the device, for every scatter so far (no host wait). Call it before
        the KV they wrote is read."""
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        for event in self._loaded:
            compute.wait_event(event)
        self._loaded.clear()

    def _ids(self, block_ids) -> torch.Tensor:
        """``block_ids`` (host ints) as an int64 index tensor on the device (through pinned memory)."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        if not self.cuda:
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)


def _runs(block_ids) -> list[tuple[int, int]]:
    """``block_ids`` as ``(first, count)`` runs of consecutive ids, in order."""
    runs: list[list[int]] = []
    for b in block_ids:
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return [(first, count) for first, count in runs]


def _blocks_shape(view: torch.Tensor, dim: int, nb: int) -> tuple[int, ...]:
    shape = list(view.shape)
    shape[dim] = nb
    return tuple(shape)


def _as_words(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors with their contiguous last dimension read as 8-byte words when all of them allow it, else as
    they are. Why: torch's CPU copy moves fp8 (1-byte) elements about 1.4x slower than the same bytes as int64
    (bench_layouts.py); the bytes, and so the round trip, are the same."""
    def fits(t: torch.Tensor) -> bool:
        size = t.element_size()
        return (size < 8 and t.dim() > 0 and t.stride(-1) == 1 and (t.shape[-1] * size) % 8 == 0
                and (t.storage_offset() * size) % 8 == 0
                and all((stride * size) % 8 == 0 for stride in t.stride()[:-1]))
    if not all(fits(t) for t in tensors):
        return tensors
    return tuple(t.view(torch.uint8).view(torch.int64) for t in tensors)


def _select(view: torch.Tensor, out: torch.Tensor, dim: int, ids: torch.Tensor) -> None:
    """``out`` <- the first ``out.shape[-3]`` tokens of blocks ``ids`` of ``view`` (CPU: straight into ``out``)."""
    n, per_block = out.shape[-3], view.shape[dim + 1] * view.shape[dim + 2]
    if n == ids.numel() * per_block:
        torch.index_select(view, dim, ids, out=out.unflatten(-3, (ids.numel(), view.shape[dim + 1], view.shape[dim + 2])))
    else:  # a partial last block (a stored partial chunk): select whole blocks, keep the first n tokens
        out.copy_(torch.index_select(view, dim, ids).flatten(dim, dim + 2)[..., :n, :, :])


def _unregister(mapping) -> None:
    """A registered mapping is about to be unmapped: no copy may still use it, then it leaves CUDA."""
    span = _REGISTERED.pop(id(mapping), None)
    if span is not None:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(span[0])


def _is_registered(t: torch.Tensor) -> bool:
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    return any(lo <= start and end <= hi for lo, hi in _REGISTERED.values())
