"""PageIO: SGLang host-pool pages into and out of a ``KVBackend``, one page per chunk.

Every call names its pages by SGLang's keys (``kvtier.pages.PageChain``) and makes one backend call (``lookup``,
``store_chunks`` or ``retrieve_chunks``), so a batch of up to 128 pages is one round trip to a server (plus the
commit or the unpin). The bytes move once: ``store_chunks`` hands each page's destination (the server's L1 slot in
shared memory, or a frame buffer) to a fill that copies the pool's page into it, and ``retrieve_chunks`` hands the
held pages' views, copied straight into the pool. A page's bytes are the pool's flat data page
(``get_data_page(index, flat=True)``), so the v1 path and the flat-tensor path (``get`` / ``set``) store the same
bytes under the same keys.

Answers follow SGLang's contract (``sglang.srt.mem_cache.hicache_storage.HiCacheStorage``): ``exists`` counts the
leading pages held; ``get_v1`` / ``set_v1`` say per page whether it was loaded or is stored. A backend that cannot
answer (server gone, slow past its deadline) answers a miss: nothing here raises for that (the caller guards the
rest). Thread-safety: as the backend's (a ``Client`` serialises its calls).
"""

from __future__ import annotations

import torch

from kvtier.layout import KVLayout
from kvtier.pages import PageChain


class PageIO:
    """Copies between one host pool and a backend.

    Args:
        backend: a ``KVBackend`` opened for ``layout`` (``sglang_config.pool_layout`` of ``pool``).
        pool: SGLang's host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``); its pages are written by
            ``get_v1`` and ``get``.
        layout: the pages' KV layout (byte size per page).
        timeout_seconds: the longest a retrieve waits on its server (``retrieve_chunks`` deadline).
    """

    def __init__(self, backend, pool, layout: KVLayout, timeout_seconds: float):
        self.backend, self.pool, self.layout, self.timeout_seconds = backend, pool, layout, timeout_seconds
        self.page_size = pool.page_size
        self.dtype = pool.dtype
        self.page_shape = tuple(pool.get_data_page(0, flat=False).shape)

    def chain(self, keys, extra_info=None) -> PageChain:
        """The ``PageChain`` of SGLang's hex ``keys``, its parent from ``extra_info.prefix_keys`` when SGLang passes
        them (``hicache_storage_pass_prefix_keys``). Raises InputError on a key that is not hex."""
        return PageChain.from_hex(keys, self.page_size, getattr(extra_info, "prefix_keys", None))

    def _as_page(self, array) -> torch.Tensor:
        """A backend chunk view (numpy, C-contiguous) as a tensor of the pool's dtype and page shape (no copy)."""
        return torch.from_numpy(array).view(self.dtype).view(self.page_shape)

    def exists(self, chain: PageChain) -> int:
        """Leading pages of ``chain`` the backend holds (one lookup)."""
        return self.backend.lookup(chain) // self.page_size if len(chain) else 0

    def set_v1(self, chain: PageChain, host_indices: torch.Tensor) -> list[bool]:
        """Store the pool's pages at ``host_indices`` (``len(chain) * page_size`` token slots, one page each
        ``page_size``) under ``chain``. Per page: True when the backend holds it afterwards."""
        starts = host_indices[::self.page_size].tolist()
        return self._store(chain, lambda i: self.pool.get_data_page(starts[i], flat=False))

    def set_flat(self, chain: PageChain, values) -> list[bool]:
        """Store flat pages (``get_data_page(index, flat=True)`` tensors, one per key) under ``chain``."""
        return self._store(chain, lambda i: values[i].view(self.page_shape))

    def _store(self, chain: PageChain, page_of) -> list[bool]:
        asked = []

        def fill(start: int, dst) -> None:
            i = start // self.page_size
            self._as_page(dst).copy_(page_of(i))
            asked.append(i)

        stored = self.backend.store_chunks(chain, fill)
        if stored and stored == len(asked) == len(chain):
            return [True] * len(chain)
        # some pages were not asked for: held already, or no room; ask which lead (one more round trip)
        held = self.exists(chain)
        return [i < held for i in range(len(chain))]

    def get_v1(self, chain: PageChain, host_indices: torch.Tensor) -> list[bool]:
        """Load the leading pages of ``chain`` the backend holds into the pool at ``host_indices``. Per page: True
        when loaded (a leading run); pages after the first miss, or all when the copy was invalidated (the
        server's pin ran out), are False and their pool slots unspecified."""
        starts = host_indices[::self.page_size].tolist()
        return self._load(chain, lambda i, page: self.pool.get_data_page(starts[i], flat=False).copy_(page))

    def get_flat(self, chain: PageChain, targets) -> list[bool]:
        """Load the leading held pages of ``chain`` into flat tensors ``targets`` (one per key); per page: loaded."""
        return self._load(chain, lambda i, page: targets[i].view(self.page_shape).copy_(page))

    def _load(self, chain: PageChain, put) -> list[bool]:
        with self.backend.retrieve_chunks(chain, timeout_seconds=self.timeout_seconds) as got:
            for start, view in got.chunks:
                put(start // self.page_size, self._as_page(view))
        loaded = got.num_tokens // self.page_size if got.ok else 0
        return [i < loaded for i in range(len(chain))]
