"""RAG over ``HFConnector`` as a pipeline meets it: ingest documents ahead of queries, then query by text or ids.

``RAG.ingest`` stores each document's KV after each system prefix it will be asked under
(``HFConnector.store_document``); ``RAG.query`` assembles ``[prefix][documents...][question]``, marks it as
``kvtier.blend.Segment`` s and runs the blended prefill (``HFConnector.prefill_segments``), reusing every
ingested document wherever it stands.

Tokenization (why parts are tokenized apart): a document's stored KV is found by its own token ids, so a document
is tokenized alone (no special tokens), the same ids wherever it stands; the question likewise; the prefix as a
prompt's start (with the tokenizer's special tokens: Gemma's BOS). End each document with a separator (a blank
line) so the next part starts cleanly. Pass token ids instead of text for full control.

A stored document depends on the prefix it was computed after: **a changed system prompt makes every stored
document miss** (recomputed, never wrong). Ingest under every prefix in use (``prefixes=[...]``), and again after
the prompt changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.blend.knobs import (DEFAULT_CHECK_LAYER, DEFAULT_FRACTION, DEFAULT_HEAD_TOKENS, DEFAULT_REFINE_LAYERS,
                                DEFAULT_WIDEN, check_knobs)
from kvtier.blend.segments import Segment, segments_from_lengths
from kvtier.blend.select import check_fraction
from kvtier.connectors.hf_kv import chunk_size_of
from kvtier.errors import InputError
from kvtier.hashing import as_token_array


@dataclass
class BlendedPrefill:
    """What ``RAG.query`` returns.

    Attributes:
        input_ids: ``[1, T]`` long, the assembled prompt. segments: the ``Segment`` s that tile it (a document
            shorter than one chunk is ``"text"``: computed each time).
        logits: ``[1, vocab_size]`` (model dtype), the last prompt token's.
        past: a ``DynamicCache`` of all T tokens (``HFConnector.decode`` continues from it, growing it in place).
        stats: ``HFConnector.prefill_segments``' stats (``blended``, ``ttft_seconds``, ``num_recomputed_tokens``...).
    """

    input_ids: torch.Tensor
    segments: list[Segment]
    logits: torch.Tensor
    past: object
    stats: dict = field(default_factory=dict)


def _is_ids(x) -> bool:
    """One token-id sequence (a tensor, an array or a list of ints), not a list of parts."""
    if hasattr(x, "dim") or hasattr(x, "ndim"):
        return True
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _parts(x, what: str) -> list:
    """``x`` as a list of parts: one text or one id sequence becomes a list of one."""
    if isinstance(x, str) or _is_ids(x):
        return [x]
    if not isinstance(x, (list, tuple)):
        raise InputError(f"{what} must be a text, token ids, or a list of those; got {type(x).__name__}")
    return list(x)


class RAG:
    """Blended RAG over one ``HFConnector``, with the knobs fixed once.

    Args:
        connector: an ``HFConnector`` (its model and cache).
        tokenizer: the model's Hugging Face tokenizer; needed only for parts given as text.
        fraction, head_tokens, check_layer, refine_layers, widen: blending's knobs (``kvtier.blend``; defaults
            ``DEFAULT_*`` there).
        allow_fallback: a model blending cannot serve (its RoPE, its attention) gets prefix reuse only, logged
            once and counted in ``kvtier_blend_fallbacks_total``; False (default): ``BlendUnsupportedError``.

    Raises:
        InputError: a bad knob.
    """

    def __init__(self, connector, tokenizer=None, *, fraction: float = DEFAULT_FRACTION,
                 head_tokens: int = DEFAULT_HEAD_TOKENS, check_layer: int = DEFAULT_CHECK_LAYER,
                 refine_layers: int = DEFAULT_REFINE_LAYERS, widen: float = DEFAULT_WIDEN,
                 allow_fallback: bool = False):
        self.connector = connector
        self.tokenizer = tokenizer
        check_knobs(head_tokens, check_layer, refine_layers, widen, connector.layout.num_layers)
        self.knobs = {"fraction": check_fraction(fraction), "head_tokens": head_tokens, "check_layer": check_layer,
                      "refine_layers": refine_layers, "widen": widen, "allow_fallback": bool(allow_fallback)}

    def tokens(self, part, what: str, *, special: bool = False) -> list[int]:
        """One part's token ids: ids as given (validated), text through the tokenizer (its special tokens only
        with ``special``: a prompt's start). Raises InputError on bad ids, or text without a tokenizer."""
        if isinstance(part, str):
            if self.tokenizer is None:
                raise InputError(f"the {what} is text but this RAG has no tokenizer; pass RAG(connector, tokenizer) "
                                 "or token ids")
            return list(self.tokenizer(part, add_special_tokens=special).input_ids)
        try:
            return as_token_array(part).tolist()
        except InputError as exc:
            raise InputError(f"the {what} must be a text or token ids: {exc}") from exc

    def ingest(self, documents, prefixes=None) -> list[dict]:
        """Store each document's KV after each prefix, ahead of any query (a document already stored after that
        prefix is skipped).

        Args:
            documents: a document or a list of them, each a text or token ids, at least one chunk long.
            prefixes: the system prefix (text or ids) queries will start with, or a list of several (each
                document is stored once per prefix); None: no prefix (documents computed from position 0).

        Returns: one ``HFConnector.store_document`` stats dict per (prefix, document), prefix-major.

        Mutates: the cache.

        Raises:
            InputError: bad ids, text without a tokenizer, a document shorter than one chunk.
            BlendUnsupportedError: the model cannot be blended and ``allow_fallback`` is False.
        """
        docs = [self.tokens(d, f"document {i}") for i, d in enumerate(_parts(documents, "documents"))]
        heads = [[]] if prefixes is None else [self.tokens(p, f"prefix {i}", special=True)
                                                for i, p in enumerate(_parts(prefixes, "prefixes"))]
        return [self.connector.store_document(doc, head, allow_fallback=self.knobs["allow_fallback"])
                for head in heads for doc in docs]

    def prompt(self, prefix, documents, question) -> tuple[torch.Tensor, list[Segment]]:
        """``(input_ids [1, T], segments)`` of ``[prefix][documents...][question]`` (``prefix`` None: none). A
        document shorter than one chunk becomes a ``"text"`` segment (computed each time, never stored)."""
        chunk = chunk_size_of(self.connector.cache) or 1
        parts = [] if prefix is None else [(self.tokens(prefix, "prefix", special=True), "prefix")]
        for i, doc in enumerate(_parts(documents, "documents")):
            ids = self.tokens(doc, f"document {i}")
            parts.append((ids, "doc" if len(ids) >= chunk else "text"))
        parts.append((self.tokens(question, "question"), "text"))
        parts = [(ids, kind) for ids, kind in parts if ids]
        if not parts:
            raise InputError("the prompt is empty: give a question, documents or a prefix")
        ids = torch.tensor([[t for p, _ in parts for t in p]], dtype=torch.long)
        return ids, segments_from_lengths([len(p) for p, _ in parts], [k for _, k in parts])

    def query(self, prefix, documents, question) -> BlendedPrefill:
        """Blended prefill of ``[prefix][documents...][question]``: each ingested document's KV reused wherever it
        stands, a document not stored yet computed after the prefix and stored (as ``ingest`` would).

        Args:
            prefix: text or token ids, or None; the same prefix the documents were ingested after, else they miss.
            documents: a document or a list of them (text or ids), in the order the prompt shows them.
            question: text or ids, e.g. "Question: ...?" with the chat template's end of turn.

        Returns: a ``BlendedPrefill`` (the prompt, its segments, last-token logits, the KV of every token, stats).

        Mutates: the cache.

        Raises:
            InputError: bad parts. BlendUnsupportedError: the model cannot be blended and ``allow_fallback`` is
            False.
        """
        ids, segments = self.prompt(prefix, documents, question)
        logits, past, stats = self.connector.prefill_segments(ids, segments, **self.knobs)
        return BlendedPrefill(ids, segments, logits, past, stats)
