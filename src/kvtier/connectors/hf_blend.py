"""Blended prefill for ``HFConnector``: reuse each document's KV wherever it stands in the prompt.

``prefill_segments`` takes a prompt marked as ``kvtier.blend.Segment`` s: the prefix goes through ordinary
prefix chunks (exact KV); each document (``"doc"``) is looked up under its own key (``keys.segment_namespace``:
the document's tokens, the model identity, the layout and the cache's namespace), computed alone and stored
once when missing, its K re-rotated to where it stands now (``blend.rope``); then ``blend.recompute`` recomputes
the question, each document's first ``head_tokens`` tokens and the ``fraction`` of reused tokens whose KV
deviates most. A segment stored by another model or layout has another key: a miss, never wrong KV.
"""

from __future__ import annotations

import time

import torch

from kvtier.blend.recompute import blend_prefill
from kvtier.blend.rope import RopeRotator
from kvtier.blend.segments import validate_segments
from kvtier.blend.select import check_fraction
from kvtier.connectors.hf import _chunk_size, dynamic_cache_to_kv
from kvtier.errors import BlendUnsupportedError, InputError
from kvtier.keys import segment_namespace

DEFAULT_FRACTION = 0.15
DEFAULT_HEAD_TOKENS = 1


def _doc_kv(connector, doc_ids: torch.Tensor, namespace: str) -> tuple[torch.Tensor, bool]:
    """The document's KV as computed alone at positions ``0 .. n-1`` ``(L, 2, n, H, D)``, and whether it was a
    hit. A miss (or a partial hit) computes it alone and stores it."""
    cache, tokens = connector.cache, doc_ids[0]
    n = tokens.shape[0]
    if connector.cache.lookup(tokens, namespace) >= n:
        kv, got = cache.retrieve(tokens, namespace)
        if int(got) == n:
            connector._check_retrieved(kv, n, n)
            return kv, True
    out = connector.model(doc_ids, attention_mask=torch.ones_like(doc_ids), use_cache=True, logits_to_keep=1)
    kv = dynamic_cache_to_kv(out.past_key_values, n)
    cache.store(tokens, kv, namespace)
    return kv, False


@torch.inference_mode()
def prefill_segments(connector, input_ids, segments, *, fraction: float = DEFAULT_FRACTION,
                     head_tokens: int = DEFAULT_HEAD_TOKENS, check_layer: int = 1):
    """Blended prefill of one prompt marked as segments (see the module docstring).

    Args:
        connector: an ``HFConnector``.
        input_ids: token ids ``[T]`` or ``[1, T]``.
        segments: ``kvtier.blend.Segment`` s tiling the prompt (``blend.validate_segments``).
        fraction: share of the reused document tokens recomputed, in [0, 1]; 1 is a full prefill (no reuse).
        head_tokens: first tokens of each reused document always recomputed (>= 0).
        check_layer: the layer whose K/V deviation selects the tokens (1 .. num_layers - 1).

    Returns:
        ``(logits_last [1, vocab], DynamicCache of all T tokens, stats)``; stats as ``HFConnector.prefill`` plus
        ``blended`` (False when the model cannot be re-rotated: then ``blend_refused`` says why and the prompt
        went through ``prefill``), ``num_segment_hit_tokens``, ``num_segment_stored``, ``num_recomputed_tokens``.

    Mutates: the cache (missing documents stored under segment keys; the prefix's full chunks under prefix keys).

    Raises:
        InputError: bad token ids, segments, fraction, head_tokens or check_layer.
    """
    started = time.perf_counter()
    ids = connector._tokens(input_ids)
    T = ids.shape[1]
    fraction = check_fraction(fraction)
    segs = validate_segments(segments, T, _chunk_size(connector.cache) or 1)
    num_layers = connector.layout.num_layers
    if not isinstance(head_tokens, int) or head_tokens < 0:
        raise InputError(f"head_tokens must be an int >= 0, got {head_tokens!r}")
    if not isinstance(check_layer, int) or not 1 <= check_layer < num_layers:
        raise InputError(f"check_layer must be an int in [1, {num_layers - 1}], got {check_layer!r}")
    try:
        rotator = RopeRotator.for_model(connector.model)
    except BlendUnsupportedError as exc:
        logits, past, stats = connector.prefill(ids)
        stats.update(blended=False, blend_refused=str(exc))
        return logits, past, stats
    if fraction == 1.0:  # recompute everything: a plain full prefill, exactly
        out = connector.model(ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
        ready = time.perf_counter()
        return out.logits[:, -1, :], out.past_key_values, {
            "num_prompt_tokens": T, "num_hit_tokens": 0, "num_computed_tokens": T, "num_stored_chunks": 0,
            "blended": False, "num_segment_hit_tokens": 0, "num_segment_stored": 0, "num_recomputed_tokens": T,
            "ttft_seconds": ready - started}

    kv = torch.zeros(connector.layout.chunk_shape(T), dtype=connector.model.dtype)
    reused = torch.zeros(T, dtype=torch.bool)
    exact = torch.zeros(T, dtype=torch.bool)
    forced = torch.zeros(T, dtype=torch.bool)
    forced[-1] = True
    ns = segment_namespace(getattr(connector.cache, "namespace", "") or "")
    num_prefix_hit = hit_tokens = stored_docs = 0
    for seg in segs:
        if seg.kind == "prefix":
            tokens = ids[0, :seg.end]
            if connector.cache.lookup(tokens) > 0:
                got_kv, got = connector.cache.retrieve(tokens)
                num_prefix_hit = min(int(got), seg.end)
                if num_prefix_hit:
                    connector._check_retrieved(got_kv, int(got), T)
                    kv[:, :, :num_prefix_hit] = got_kv[:, :, :num_prefix_hit]
                    reused[:num_prefix_hit] = exact[:num_prefix_hit] = True
        elif seg.kind == "doc":
            doc_kv, hit = _doc_kv(connector, ids[:, seg.start:seg.end], ns)
            stored_docs += not hit
            hit_tokens += seg.num_tokens if hit else 0
            kv[:, 0, seg.start:seg.end] = rotator.rotate(doc_kv[:, 0], seg.start)
            kv[:, 1, seg.start:seg.end] = doc_kv[:, 1]
            reused[seg.start:seg.end] = True
            forced[seg.start:seg.start + head_tokens] = True
    assembled = time.perf_counter()
    logits, past, num_recomputed = blend_prefill(connector.model, ids, kv, reused, forced, fraction, check_layer,
                                                 exact=exact)
    ready = time.perf_counter()
    num_stored = 0
    if segs[0].kind == "prefix":  # the prefix attends to itself only: its blended KV is exact
        num_stored = connector._store(ids[0, :segs[0].end], past, num_prefix_hit)
    return logits, past, {
        "num_prompt_tokens": T, "num_hit_tokens": int(reused.sum()), "num_computed_tokens": num_recomputed,
        "num_stored_chunks": num_stored, "blended": True, "num_segment_hit_tokens": hit_tokens,
        "num_segment_stored": stored_docs, "num_recomputed_tokens": num_recomputed,
        "retrieve_seconds": assembled - started, "prefill_seconds": ready - assembled,
        "store_seconds": time.perf_counter() - ready, "ttft_seconds": ready - started}
