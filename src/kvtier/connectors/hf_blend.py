"""Blended prefill for ``HFConnector``: reuse each document's KV wherever it stands in the prompt.

``prefill_segments`` takes a prompt marked as ``kvtier.blend.Segment`` s. The prefix (the first segment, when
its kind is ``"prefix"``: a system prompt, a chat template's head) goes through ordinary prefix chunks (exact
KV). Each document (``"doc"``) is computed **after the prefix** (positions ``P .. P + n - 1``) and stored once
under its own key (``keys.segment_namespace``: the document's tokens, the prefix's tokens it was computed after,
the model identity, the layout and the cache's namespace). Computing a document after the prefix, not alone from
position 0, keeps the prefix's first token the attention sink of every document, as in the full prompt, and
makes the document right after the prefix exact. On load a document's K is re-rotated from where it was computed
to where it stands now (``blend.rope``); then ``blend.recompute`` recomputes the question, each later document's
first ``head_tokens`` tokens and the ``fraction`` of reused tokens whose KV deviates most. A segment stored by
another model, layout or after another prefix has another key: a miss, never wrong KV. So a changed system
prompt (another prefix, even by one token) makes every stored document miss: ingest the documents again after
the new prefix (``store_document``; several prefixes may be ingested side by side).

``store_document`` is the ingest: a document's KV computed after a prefix and stored under its segment key ahead
of any query. Blending is explicit: a model it cannot serve (``RopeRotator.for_model``, ``check_attention``)
raises ``BlendUnsupportedError`` unless the caller passes ``allow_fallback=True``; then the prefill is plain
prefix reuse, logged once per model type and reason and counted in ``kvtier_blend_fallbacks_total``.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import DynamicCache

from kvtier.blend.assemble import KVAssembly
from kvtier.blend.knobs import (DEFAULT_CHECK_LAYER, DEFAULT_FRACTION, DEFAULT_HEAD_TOKENS, DEFAULT_REFINE_LAYERS,
                                DEFAULT_WIDEN, check_knobs)
from kvtier.blend.recompute import blend_prefill, cache_over, check_attention
from kvtier.blend.rope import RopeRotator
from kvtier.blend.segments import Segment, validate_segments
from kvtier.blend.select import check_fraction
from kvtier.connectors.hf_kv import chunk_size_of, dynamic_cache_to_kv
from kvtier.errors import BlendUnsupportedError, InputError
from kvtier.keys import segment_namespace
from kvtier.tensors import as_torch

log = logging.getLogger("kvtier.blend")
_warned: set[tuple[str, str]] = set()  # (model type, reason) already logged: a fallback is logged once


def blend_support(model) -> RopeRotator:
    """The model's ``RopeRotator`` when blending can serve it (its RoPE re-rotates, its attention takes our masks).

    Raises:
        BlendUnsupportedError: naming the model type and why.
    """
    check_attention(model)
    return RopeRotator.for_model(model)


def _refused(connector, exc: BlendUnsupportedError, allow_fallback: bool) -> str:
    """Re-raise ``exc`` unless ``allow_fallback``; else count it, log it once per model type and reason, return
    the reason."""
    if not allow_fallback:
        raise exc
    reason = str(exc)
    connector.metrics.inc("kvtier_blend_fallbacks_total")
    key = (getattr(connector.model.config, "model_type", ""), reason)
    if key not in _warned:
        _warned.add(key)
        log.warning("blending is off for this model, prefix reuse only (allow_fallback=True): %s", reason)
    return reason


def _load(cache, tokens: torch.Tensor, namespace: str | None, asm: KVAssembly, at: int, rotator=None,
          offset: int = 0) -> int:
    """Copy the stored KV of ``tokens``'s leading chunks into ``asm`` at token ``at`` (K rotated by ``offset``);
    returns how many tokens it holds (0 when the backend's pins ran out meanwhile: the copy is void)."""
    dtype = asm.buf.dtype
    with cache.retrieve_chunks(tokens, namespace) as got:
        for start, view in got.chunks:
            asm.put(at + start, as_torch(view, dtype), rotator, offset)
        num = int(got.num_tokens)
    return num if got.ok else 0


@torch.inference_mode()
def _compute_docs(connector, ids, context: int, asm: KVAssembly, missing, rotator) -> list[tuple]:
    """Compute each missing document after the prefix ``ids[:, :context]`` (computed first when ``asm`` does not
    hold all of it exactly), put it into ``asm``; returns ``[(segment, kv (L, 2, n, H, D))]`` to store."""
    model = connector.model
    if context and not bool(asm.exact[:context].all()):
        out = model(ids[:, :context], past_key_values=DynamicCache(), attention_mask=torch.ones_like(ids[:, :context]),
                    use_cache=True, logits_to_keep=1)
        asm.put(0, dynamic_cache_to_kv(out.past_key_values, context))
        asm.reused[:context] = asm.exact[:context] = True
    keys = [k[:, :, :context] for k in asm.keys]
    values = [v[:, :, :context] for v in asm.values]
    computed = []
    for seg in missing:
        doc = ids[:, seg.start:seg.end]
        past = cache_over(keys, values) if context else DynamicCache()  # the model's update copies, never writes
        out = model(doc, past_key_values=past, attention_mask=torch.ones((1, context + doc.shape[1]), dtype=torch.long),
                    use_cache=True, logits_to_keep=1)
        kv = dynamic_cache_to_kv(out.past_key_values, seg.num_tokens, start=context)
        asm.put(seg.start, kv, rotator, seg.start - context)
        computed.append((seg, kv))
    return computed


@torch.inference_mode()
def store_document(connector, document_ids, prefix_ids=None, *, allow_fallback: bool = False) -> dict:
    """Ingest one document: compute its KV after ``prefix_ids`` and store it under its segment key (the document's
    tokens, the prefix's tokens, the model, the layout), ready for any later prompt ``[prefix][...][document][...]``.

    The prefix's full chunks are stored too (under prefix keys), and a prefix already stored is reused, not
    recomputed. A document already stored after this prefix is not computed again.

    Args:
        connector: an ``HFConnector``.
        document_ids: the document's token ids ``[n]`` (tokenized alone: the same ids wherever it will stand), at
            least one chunk long.
        prefix_ids: the system prefix's token ids ``[P]`` (the prompt's head, as every query will start), or None
            / empty: the document computed alone from position 0 (only prompts without a prefix will find it).
        allow_fallback: when the model cannot be blended, store nothing and count a fallback instead of raising.

    Returns:
        stats: ``num_document_tokens``, ``stored`` (True when newly stored), ``num_prefix_hit_tokens``,
        ``num_stored_chunks`` (the prefix's), ``ingest_seconds``; ``blend_refused`` (why) after a fallback.

    Mutates: the cache.

    Raises:
        InputError: bad token ids, a document shorter than one chunk. BlendUnsupportedError: the model cannot be
        blended and ``allow_fallback`` is False.
    """
    started = time.perf_counter()
    doc = connector.prompt_ids(document_ids)[0]
    empty = prefix_ids is None or (hasattr(prefix_ids, "__len__") and len(prefix_ids) == 0)
    prefix = doc[:0] if empty else connector.prompt_ids(prefix_ids)[0]
    P, n = int(prefix.numel()), int(doc.numel())
    chunk = chunk_size_of(connector.cache) or 1
    stats = {"num_document_tokens": n, "stored": False, "num_prefix_hit_tokens": 0, "num_stored_chunks": 0}
    if n < chunk:
        raise InputError(f"the document has {n} tokens, shorter than one chunk ({chunk} tokens): not worth storing; "
                         "put it in the prompt as text (computed each time) or use a smaller chunk_size")
    try:
        blend_support(connector.model)
    except BlendUnsupportedError as exc:
        stats["blend_refused"] = _refused(connector, exc, allow_fallback)
        return {**stats, "ingest_seconds": time.perf_counter() - started}
    cache = connector.cache
    ns = segment_namespace(getattr(cache, "namespace", "") or "", prefix)
    if cache.lookup(doc, ns) >= n:
        return {**stats, "ingest_seconds": time.perf_counter() - started}
    layout = connector.layout
    asm = KVAssembly(layout.num_layers, layout.num_kv_heads, layout.head_dim, P + n, connector.model.dtype)
    hit = _load(cache, prefix, None, asm, 0) if P else 0
    asm.reused[:hit] = asm.exact[:hit] = True
    ids = torch.cat([prefix, doc])[None]
    (_, kv), = _compute_docs(connector, ids, P, asm, [Segment(P, P + n)], None)
    cache.store(doc, kv, ns)
    if P:
        past = cache_over([k[:, :, :P] for k in asm.keys], [v[:, :, :P] for v in asm.values])
        stats["num_stored_chunks"] = connector.store_prompt(prefix, past, hit)
    stats.update(stored=True, num_prefix_hit_tokens=hit)
    return {**stats, "ingest_seconds": time.perf_counter() - started}


@torch.inference_mode()
def prefill_segments(connector, input_ids, segments, *, fraction: float = DEFAULT_FRACTION,
                     head_tokens: int = DEFAULT_HEAD_TOKENS, check_layer: int = DEFAULT_CHECK_LAYER,
                     refine_layers: int = DEFAULT_REFINE_LAYERS, widen: float = DEFAULT_WIDEN,
                     allow_fallback: bool = False):
    """Blended prefill of one prompt marked as segments (see the module docstring).

    Args:
        connector: an ``HFConnector``.
        input_ids: token ids ``[T]`` or ``[1, T]``.
        segments: ``kvtier.blend.Segment`` s tiling the prompt (``blend.validate_segments``).
        fraction: share of the reused document tokens recomputed, in [0, 1]; 1 is a full prefill (no reuse).
        head_tokens: first tokens of each reused document always recomputed (>= 0; not for the document right
            after the prefix, whose KV is exact).
        check_layer: the layer whose K/V deviation selects the tokens (1 .. num_layers - 1).
        refine_layers: CacheBlend's gradual filtering: layers after the check layer that narrow a selection
            ``widen`` times larger down to ``fraction`` (0: select once).
        widen: see ``refine_layers`` (>= 1).
        allow_fallback: when the model cannot be blended, run a plain prefix-reuse prefill (``HFConnector.prefill``),
            log it once and count ``kvtier_blend_fallbacks_total``, instead of raising.

    Returns:
        ``(logits_last [1, vocab], DynamicCache of all T tokens, stats)``; stats as ``HFConnector.prefill`` plus
        ``blended`` (False after a fallback, with ``blend_refused`` saying why, or at ``fraction`` 1),
        ``num_segment_hit_tokens``, ``num_segment_stored``, ``num_recomputed_tokens``.

    Mutates: the cache (missing documents stored under segment keys; the prefix's full chunks under prefix keys).

    Raises:
        InputError: bad token ids, segments, fraction, head_tokens, check_layer, refine_layers or widen.
        BlendUnsupportedError (an InputError): the model cannot be blended and ``allow_fallback`` is False.
    """
    started = time.perf_counter()
    ids = connector.prompt_ids(input_ids)
    T = ids.shape[1]
    fraction = check_fraction(fraction)
    segs = validate_segments(segments, T, chunk_size_of(connector.cache) or 1)
    layout = connector.layout
    check_knobs(head_tokens, check_layer, refine_layers, widen, layout.num_layers)
    try:
        rotator = blend_support(connector.model)
    except BlendUnsupportedError as exc:
        reason = _refused(connector, exc, allow_fallback)
        logits, past, stats = connector.prefill(ids)
        stats.update(blended=False, blend_refused=reason)
        return logits, past, stats
    if fraction == 1.0:  # recompute everything: a plain full prefill, exactly
        out = connector.model(ids, past_key_values=DynamicCache(), attention_mask=torch.ones_like(ids), use_cache=True,
                              logits_to_keep=1)
        ready = time.perf_counter()
        return out.logits[:, -1, :], out.past_key_values, {
            "num_prompt_tokens": T, "num_hit_tokens": 0, "num_computed_tokens": T, "num_stored_chunks": 0,
            "blended": False, "num_segment_hit_tokens": 0, "num_segment_stored": 0, "num_recomputed_tokens": T,
            "ttft_seconds": ready - started}

    cache = connector.cache
    asm = KVAssembly(layout.num_layers, layout.num_kv_heads, layout.head_dim, T, connector.model.dtype)
    context = segs[0].end if segs[0].kind == "prefix" else 0  # documents are computed after these tokens
    ns = segment_namespace(getattr(cache, "namespace", "") or "", ids[0, :context])
    num_prefix_hit = _load(cache, ids[0, :context], None, asm, 0) if context else 0
    asm.reused[:num_prefix_hit] = asm.exact[:num_prefix_hit] = True
    hit_tokens, missing = 0, []
    for seg in segs:
        if seg.kind == "doc":
            if _load(cache, ids[0, seg.start:seg.end], ns, asm, seg.start, rotator, seg.start - context) == seg.num_tokens:
                hit_tokens += seg.num_tokens
            else:
                missing.append(seg)
    computed = _compute_docs(connector, ids, context, asm, missing, rotator) if missing else []
    for seg in segs:
        if seg.kind == "doc":
            asm.reused[seg.start:seg.end] = True
            if seg.start == context:  # computed right after the context it stands after now: exact
                asm.exact[seg.start:seg.end] = True
            else:
                asm.forced[seg.start:seg.start + head_tokens] = True
        else:  # the prefix's hit is a leading run; the rest, and the question, are computed
            todo = torch.nonzero(~asm.reused[seg.start:seg.end]).flatten()
            if todo.numel():
                asm.zero(seg.start + int(todo[0]), seg.end)
    assembled = time.perf_counter()
    logits, past, num_recomputed = blend_prefill(
        connector.model, ids, asm.keys, asm.values, asm.reused, asm.forced, fraction, check_layer=check_layer,
        exact=asm.exact, refine_layers=refine_layers, widen=widen, rotator=rotator)
    ready = time.perf_counter()
    for seg, kv in computed:
        cache.store(ids[0, seg.start:seg.end], kv, ns)
    num_stored = connector.store_prompt(ids[0, :context], past, num_prefix_hit) if context else 0
    return logits, past, {
        "num_prompt_tokens": T, "num_hit_tokens": num_prefix_hit + hit_tokens,
        "num_computed_tokens": num_recomputed, "num_stored_chunks": num_stored, "blended": True,
        "num_segment_hit_tokens": hit_tokens, "num_segment_stored": len(computed),
        "num_recomputed_tokens": num_recomputed, "retrieve_seconds": assembled - started,
        "prefill_seconds": ready - assembled, "store_seconds": time.perf_counter() - ready,
        "ttft_seconds": ready - started}

