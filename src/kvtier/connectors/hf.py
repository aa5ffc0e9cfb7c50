"""Run a transformers causal LM with kvtier: reuse the KV of a known prefix, prefill only the rest.

Flow of ``HFConnector.prefill``: ``lookup`` the prompt; ``retrieve`` the leading chunks; rebuild a
``DynamicCache`` from them; run the model on the remaining tokens only (with ``past_key_values=`` and an
explicit all-ones attention mask, the two pitfalls named in reference/engines-and-services.md §2);
then ``store`` the prompt's full chunks so the next prompt with this prefix reuses them.

Layouts: kvtier chunks are ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)``; a ``DynamicCache``
layer holds keys and values as ``[batch, num_kv_heads, num_tokens, head_dim]`` (batch is 1 here).

At least one prompt token is always computed, because the first output token needs the logits of the
last prompt token and kvtier stores KV, not logits. When every token of the prompt is stored (its length
is a multiple of the chunk size and all chunks hit), the last token's KV is dropped from the rebuilt cache
and that one token is recomputed; the result equals a full prefill.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from kvtier.errors import InputError, KVTierError
from kvtier.hashing import as_token_array
from kvtier.connectors.hf_blend import prefill_segments, store_document
from kvtier.connectors.hf_kv import chunk_size_of, dynamic_cache_to_kv, kv_to_dynamic_cache, model_identity_of
from kvtier.layout import KVLayout
from kvtier.metrics import Metrics


class HFConnector:
    """A transformers causal LM whose prefill reuses KV through kvtier.

    Args:
        model: a loaded ``PreTrainedModel`` (decoder-only, batch 1). A model with sliding-window layers (Gemma-3)
            works too: its caches are kept as full layers (``kv_to_dynamic_cache``), so every layer's chunk holds
            all its tokens, as kvtier's layout ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` says.
        cache: a ``kvtier.cache.KVCache`` or ``kvtier.client.Client``: anything with ``lookup(tokens) -> int``,
            ``retrieve(tokens) -> (kv, n)`` and ``store(tokens, kv) -> int`` for this model's KV layout.
        model_id: the model id the cache was opened with (``model_identity_of(model)`` for a model loaded from a
            folder or the hub); checked against ``cache.model`` when both are known.

    Raises:
        InputError: the cache was opened for another model id or KV layout.
    """

    def __init__(self, model, cache, *, model_id: str | None = None):
        self.model = model
        self.cache = cache
        self.layout = KVLayout.from_model(model)
        # the cache's own counters when it has them (KVCache, Client), so a blending fallback shows with the rest
        self.metrics = getattr(cache, "metrics", None) or Metrics()
        self.model_id = model_id or getattr(cache, "model", None) or (
            model_identity_of(model) if getattr(model.config, "name_or_path", "") else None)
        cache_model = getattr(cache, "model", None)
        if model_id and isinstance(cache_model, str) and cache_model != model_id:
            raise InputError(f"the cache was opened for model {cache_model!r}, not {model_id!r}; "
                             "open one cache per model")
        cache_layout = getattr(cache, "layout", None)
        if cache_layout is not None and cache_layout != self.layout:
            raise InputError(f"the cache's KV layout {cache_layout} does not match the model's {self.layout}; "
                             "open the cache with kvtier.layout.KVLayout.from_model(model)")

    def prompt_ids(self, input_ids) -> torch.Tensor:
        """Validate one prompt (``[T]`` or ``[1, T]`` ints, T >= 1) and return it as a new ``[1, T]`` long tensor.

        Raises: InputError naming what is wrong (a batch, no tokens, an id outside the model's vocabulary)."""
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise InputError("HFConnector takes one prompt at a time (batch 1); "
                                 f"got shape {tuple(input_ids.shape)}")
            input_ids = input_ids[0]
        arr = as_token_array(input_ids)
        if arr.size == 0:
            raise InputError("the prompt is empty; pass at least one token id")
        if int(arr.max()) >= self.model.config.vocab_size:
            raise InputError(f"token id {int(arr.max())} is outside the model's vocabulary "
                             f"(vocab_size {self.model.config.vocab_size}); tokenize with the model's tokenizer")
        return torch.from_numpy(arr.copy()).unsqueeze(0)

    @torch.inference_mode()
    def prefill(self, input_ids):
        """Prefill one prompt, reusing stored KV for its leading chunks and storing its new full chunks.

        Args:
            input_ids: token ids ``[T]`` or ``[1, T]`` (list, numpy or torch), T >= 1.

        Returns:
            ``(logits_last, past_key_values, stats)``: ``logits_last`` ``[1, vocab_size]`` (model dtype) for
            the last prompt token; ``past_key_values`` a ``DynamicCache`` holding all T tokens (continue
            decoding from it); ``stats`` a dict: ``num_prompt_tokens``, ``num_hit_tokens`` (tokens whose KV
            was reused, at most T - 1), ``num_computed_tokens``, ``num_stored_chunks``, and
            ``lookup_seconds``, ``retrieve_seconds``, ``prefill_seconds``, ``store_seconds``, ``ttft_seconds``
            (call to logits ready; the store runs after that and is not part of it).

        Mutates: the cache (new chunks stored).

        Raises:
            InputError: bad token ids; KVTierError: the cache returned KV of the wrong shape or dtype.
        """
        started = time.perf_counter()
        ids = self.prompt_ids(input_ids)
        tokens = ids[0]
        num_prompt = ids.shape[1]

        num_lookup = self.cache.lookup(tokens)
        looked = time.perf_counter()
        kv, num_retrieved = (None, 0)
        if num_lookup > 0:
            kv, num_retrieved = self.cache.retrieve(tokens)
            num_retrieved = int(num_retrieved)
            if num_retrieved > 0:
                self._check_retrieved(kv, num_retrieved, num_prompt)
        # keep at least one token to compute: its logits give the first output token
        num_hit = min(num_retrieved, num_prompt - 1)
        past = kv_to_dynamic_cache(kv[:, :, :num_hit] if num_hit else self._empty_kv())
        retrieved = time.perf_counter()

        out = self.model(ids[:, num_hit:], past_key_values=past, attention_mask=torch.ones_like(ids),
                         use_cache=True, logits_to_keep=1)
        logits_last = out.logits[:, -1, :]
        ready = time.perf_counter()

        num_stored = self.store_prompt(tokens, out.past_key_values, num_retrieved)
        stored = time.perf_counter()
        stats = {
            "num_prompt_tokens": num_prompt,
            "num_hit_tokens": num_hit,
            "num_computed_tokens": num_prompt - num_hit,
            "num_stored_chunks": num_stored,
            "lookup_seconds": looked - started,
            "retrieve_seconds": retrieved - looked,
            "prefill_seconds": ready - retrieved,
            "store_seconds": stored - ready,
            "ttft_seconds": ready - started,
        }
        return logits_last, out.past_key_values, stats

    def _empty_kv(self) -> torch.Tensor:
        return torch.empty(self.layout.chunk_shape(0), dtype=self.model.dtype)

    def _check_retrieved(self, kv, num_tokens: int, num_prompt: int) -> None:
        """Refuse KV that does not fit: using it would silently corrupt the output."""
        if not isinstance(kv, torch.Tensor):
            raise KVTierError(f"the cache returned {type(kv).__name__}, not a torch tensor")
        fits = tuple(kv.shape) == self.layout.chunk_shape(num_tokens) and kv.dtype == self.model.dtype
        if num_tokens > num_prompt or not fits:
            raise KVTierError(f"the cache returned KV of shape {tuple(kv.shape)} and dtype {kv.dtype} for "
                              f"{num_tokens} tokens of a {num_prompt}-token prompt; expected "
                              f"{self.layout.chunk_shape(num_tokens)} in {self.model.dtype}")

    def store_prompt(self, tokens: torch.Tensor, past: DynamicCache, num_retrieved: int = 0) -> int:
        """Store a prompt's full chunks under prefix keys; skipped when every full chunk was just retrieved.

        Args:
            tokens: the prompt's token ids ``[T]`` (long).
            past: a ``DynamicCache`` holding at least those T tokens (read, not changed).
            num_retrieved: leading tokens just retrieved from the cache (their chunks are not copied again).

        Returns: the number of chunks newly stored. Mutates: the cache.
        """
        num_prompt = tokens.shape[0]
        chunk_size = chunk_size_of(self.cache)  # a client learns it at its (re)connection handshake
        if chunk_size is not None:
            # only full chunks are keys; the cache skips chunks it has, but building their KV costs a copy
            end = num_prompt - num_prompt % chunk_size
            if end <= num_retrieved:
                return 0
            tokens = tokens[:end]
        return int(self.cache.store(tokens, dynamic_cache_to_kv(past, tokens.shape[0])))

    def prefill_segments(self, input_ids, segments, **knobs):
        """Blended prefill of a prompt marked as ``kvtier.blend.Segment`` s: each document's KV reused wherever it
        stands (``connectors.hf_blend.prefill_segments``: the knobs ``fraction``, ``head_tokens``,
        ``check_layer``, ``refine_layers``, ``widen`` (defaults in ``kvtier.blend``), ``allow_fallback``, the
        returns, what it raises). By text: ``connectors.hf_rag.RAG``."""
        return prefill_segments(self, input_ids, segments, **knobs)

    def store_document(self, document_ids, prefix_ids=None, *, allow_fallback: bool = False) -> dict:
        """Ingest: store a document's KV under its segment key, computed after ``prefix_ids``, ahead of any query
        (``connectors.hf_blend.store_document``: the returns, what it raises)."""
        return store_document(self, document_ids, prefix_ids, allow_fallback=allow_fallback)

    @torch.inference_mode()
    def decode(self, logits, past, num_prompt_tokens: int, max_new_tokens: int = 32, eos_token_id=None) -> list[int]:
        """Greedy decoding from a prefill's ``(logits, past)``.

        Args:
            logits: ``[1, vocab_size]``, the last prompt token's (the first new token is its argmax).
            past: the prefill's ``DynamicCache`` of ``num_prompt_tokens`` tokens.
            num_prompt_tokens: tokens in ``past``.
            max_new_tokens: at most this many new tokens (>= 1).
            eos_token_id: int or list of ints that stop decoding; default the model's generation config's.

        Returns: the new token ids (an eos included).

        Mutates: ``past``, in place: each new token's K/V is appended to it (transformers' cache update), so after
        the call it holds the prompt and the answer. To decode twice from one prefill, pass ``copy.deepcopy(past)``;
        the KV already stored in kvtier is never changed.
        """
        if eos_token_id is None:
            eos_token_id = self.model.generation_config.eos_token_id
        stop = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        new = [int(logits.argmax(-1))]
        while len(new) < max_new_tokens and new[-1] not in stop:
            length = num_prompt_tokens + len(new)
            out = self.model(torch.tensor([[new[-1]]]), past_key_values=past,
                             attention_mask=torch.ones((1, length), dtype=torch.long), use_cache=True)
            past = out.past_key_values
            new.append(int(out.logits[0, -1].argmax(-1)))
        return new

    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int = 32, eos_token_id=None):
        """Greedy decoding after a kvtier-backed prefill.

        Args:
            input_ids: one prompt, ``[T]`` or ``[1, T]`` token ids.
            max_new_tokens: upper bound on generated tokens (>= 1).
            eos_token_id: int or list of ints that stop decoding (included in the output); default the
                model's ``generation_config.eos_token_id``.

        Returns:
            ``(output_ids, stats)``: ``output_ids`` ``[1, T + num_new]`` long (prompt then new tokens, like
            ``model.generate``); ``stats`` = ``prefill``'s stats plus ``num_new_tokens`` and ``decode_seconds``.

        Raises:
            InputError: bad token ids or ``max_new_tokens`` < 1.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        ids = self.prompt_ids(input_ids)
        logits, past, stats = self.prefill(ids)
        started = time.perf_counter()
        new = self.decode(logits, past, ids.shape[1], max_new_tokens, eos_token_id)
        stats["num_new_tokens"] = len(new)
        stats["decode_seconds"] = time.perf_counter() - started
        return torch.cat([ids, torch.tensor([new])], dim=1), stats
