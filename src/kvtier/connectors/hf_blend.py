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
another model, layout or after another prefix has another key: a miss, never wrong KV.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from kvtier.blend.assemble import KVAssembly
from kvtier.blend.recompute import blend_prefill, cache_over
from kvtier.blend.rope import RopeRotator
from kvtier.blend.segments import validate_segments
from kvtier.blend.select import check_fraction
from kvtier.connectors.hf_kv import chunk_size_of, dynamic_cache_to_kv
from kvtier.errors import BlendUnsupportedError, InputError
from kvtier.keys import segment_namespace
from kvtier.tensors import as_torch

# the largest fraction of benchmarks/rag_blend.py's sweep (40 prompts, SmolLM2 fp32) whose TTFT met both of issue
# 18's targets (0.31x full prefill, 0.33x prefix-only at 0.2; 0.37x at 0.3), so the best answers within them
DEFAULT_FRACTION = 0.2
DEFAULT_HEAD_TOKENS = 1
DEFAULT_REFINE_LAYERS = 0
DEFAULT_WIDEN = 2.0


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
def prefill_segments(connector, input_ids, segments, *, fraction: float = DEFAULT_FRACTION,
                     head_tokens: int = DEFAULT_HEAD_TOKENS, check_layer: int = 1,
                     refine_layers: int = DEFAULT_REFINE_LAYERS, widen: float = DEFAULT_WIDEN):
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

    Returns:
        ``(logits_last [1, vocab], DynamicCache of all T tokens, stats)``; stats as ``HFConnector.prefill`` plus
        ``blended`` (False when the model cannot be re-rotated: then ``blend_refused`` says why and the prompt
        went through ``prefill``), ``num_segment_hit_tokens``, ``num_segment_stored``, ``num_recomputed_tokens``.

    Mutates: the cache (missing documents stored under segment keys; the prefix's full chunks under prefix keys).

    Raises:
        InputError: bad token ids, segments, fraction, head_tokens, check_layer, refine_layers or widen.
    """
    started = time.perf_counter()
    ids = connector._tokens(input_ids)
    T = ids.shape[1]
    fraction = check_fraction(fraction)
    segs = validate_segments(segments, T, chunk_size_of(connector.cache) or 1)
    layout = connector.layout
    _check_knobs(head_tokens, check_layer, refine_layers, widen, layout.num_layers)
    try:
        rotator = RopeRotator.for_model(connector.model)
    except BlendUnsupportedError as exc:
        logits, past, stats = connector.prefill(ids)
        stats.update(blended=False, blend_refused=str(exc))
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
    num_stored = connector._store(ids[0, :context], past, num_prefix_hit) if context else 0
    return logits, past, {
        "num_prompt_tokens": T, "num_hit_tokens": num_prefix_hit + hit_tokens,
        "num_computed_tokens": num_recomputed, "num_stored_chunks": num_stored, "blended": True,
        "num_segment_hit_tokens": hit_tokens, "num_segment_stored": len(computed),
        "num_recomputed_tokens": num_recomputed, "retrieve_seconds": assembled - started,
        "prefill_seconds": ready - assembled, "store_seconds": time.perf_counter() - ready,
        "ttft_seconds": ready - started}


def _check_knobs(head_tokens, check_layer, refine_layers, widen, num_layers: int) -> None:
    """Raise InputError naming the first bad blending knob."""
    if not isinstance(head_tokens, int) or isinstance(head_tokens, bool) or head_tokens < 0:
        raise InputError(f"head_tokens must be an int >= 0, got {head_tokens!r}")
    if not isinstance(check_layer, int) or isinstance(check_layer, bool) or not 1 <= check_layer < num_layers:
        raise InputError(f"check_layer must be an int in [1, {num_layers - 1}], got {check_layer!r}")
    if not isinstance(refine_layers, int) or isinstance(refine_layers, bool) or refine_layers < 0:
        raise InputError(f"refine_layers must be an int >= 0, got {refine_layers!r}")
    if isinstance(widen, bool) or not isinstance(widen, (int, float)) or not widen >= 1:
        raise InputError(f"widen must be a number >= 1, got {widen!r}")
