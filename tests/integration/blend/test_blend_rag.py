"""The RAG API (issue 43) with the real SmolLM2, its tokenizer and a real KVCache: documents ingested ahead of queries
(text or ids, one prefix or several), queries reusing them wherever they stand, the knobs' home in ``kvtier.blend``,
and what ``decode`` does to the cache it continues from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier import blend
from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.connectors.hf import HFConnector
from kvtier.connectors.hf_rag import RAG
from kvtier.errors import InputError
from kvtier.demo.models import load_smollm2
from kvtier.layout import KVLayout

CHUNK = 64
pytestmark = pytest.mark.model
PREFIX = ("<|im_start|>system\nYou are a careful assistant for a legal team. Answer from the documents below only, "
          "quote them where you can, say which document you quote, and say so plainly when the documents do not "
          "answer the question. Never guess at names, dates or numbers the documents do not give. Keep answers "
          "short: one or two sentences.<|im_end|>\n<|im_start|>user\n")
QUESTION = "Question: What does the first document say about warranty?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smol():
    return load_smollm2(progress=False)


@pytest.fixture(scope="module")
def texts(smol):
    """Three real documents (licence texts Debian ships), about 150-250 tokens each, each ending in a blank line."""
    _, tok = smol
    out = []
    for i, name in enumerate(("BSD", "Apache-2.0", "MPL-2.0")):
        text = (Path("/usr/share/common-licenses") / name).read_text()
        out.append(tok.decode(tok(text, add_special_tokens=False).input_ids[:150 + 50 * i]) + "\n\n")
    return out


def _rag(smol, **knobs):
    model, tok = smol
    cache = KVCache(build_config({"chunk_size": CHUNK, "l1_size_gb": "256MiB"}), "smol", KVLayout.from_model(model))
    return RAG(HFConnector(model, cache), tok, **knobs)


@torch.inference_mode()
def test_ingested_documents_are_reused_wherever_they_stand(smol, texts):
    rag = _rag(smol)
    stats = rag.ingest(texts, PREFIX)
    assert [s["stored"] for s in stats] == [True] * 3
    assert stats[1]["num_prefix_hit_tokens"] > 0  # the prefix's chunk, stored by the first ingest, is reused
    assert [s["stored"] for s in rag.ingest(texts[0], PREFIX)] == [False]  # already there
    docs = [texts[2], texts[0], texts[1]]
    out = rag.query(PREFIX, docs, QUESTION)
    num_doc_tokens = sum(s.num_tokens for s in out.segments if s.kind == "doc")
    assert [s.kind for s in out.segments] == ["prefix", "doc", "doc", "doc", "text"]
    assert out.stats["blended"] and out.stats["num_segment_stored"] == 0
    assert out.stats["num_segment_hit_tokens"] == num_doc_tokens
    assert out.stats["num_recomputed_tokens"] < out.input_ids.shape[1] / 2
    full = rag.connector.model(out.input_ids, use_cache=True, logits_to_keep=1).logits[:, -1]
    assert int(out.logits.argmax()) == int(full.argmax())
    # the same prompt given as token ids is the same prompt
    ids = rag.prompt([int(t) for t in rag.tokens(PREFIX, "p", special=True)], [rag.tokens(d, "d") for d in docs],
                     rag.tokens(QUESTION, "q"))[0]
    assert torch.equal(ids, out.input_ids)


@torch.inference_mode()
def test_documents_ingested_under_several_prefixes_and_a_changed_prefix_misses(smol, texts):
    rag = _rag(smol, fraction=0.0)
    _, tok = smol
    other = PREFIX.replace("Answer", "Reply")
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts[:2]]
    assert [s["stored"] for s in rag.ingest(ids, [PREFIX, other])] == [True] * 4
    for prefix in (PREFIX, other):
        out = rag.query(prefix, ids[::-1], QUESTION)
        assert out.stats["num_segment_stored"] == 0 and out.stats["num_segment_hit_tokens"] == sum(map(len, ids))
    changed = PREFIX.replace("below", "that follow")  # a changed system prompt: every stored document misses
    out = rag.query(changed, ids[::-1], QUESTION)
    assert out.stats["num_segment_hit_tokens"] == 0 and out.stats["num_segment_stored"] == 2
    assert rag.ingest(ids, changed)[0]["stored"] is False  # the query stored them after the new prefix


@torch.inference_mode()
def test_short_documents_are_text_and_text_needs_a_tokenizer(smol, texts):
    rag = _rag(smol)
    _, segments = rag.prompt(PREFIX, [texts[0], "A short note.\n\n"], QUESTION)
    assert [s.kind for s in segments] == ["prefix", "doc", "text", "text"]
    with pytest.raises(InputError, match="shorter than one chunk"):
        rag.ingest("A short note.\n\n", PREFIX)
    bare = RAG(rag.connector)
    with pytest.raises(InputError, match="no tokenizer"):
        bare.query(PREFIX, texts[0], QUESTION)
    with pytest.raises(InputError, match="document 0"):
        bare.ingest([[1, -2, 3]], None)
    with pytest.raises(InputError, match=r"\[0, 1\]"):
        RAG(rag.connector, fraction=2)


@torch.inference_mode()
def test_the_knobs_defaults_live_in_kvtier_blend(smol, texts):
    rag = _rag(smol)
    assert rag.knobs["fraction"] == blend.DEFAULT_FRACTION == 0.2
    assert (rag.knobs["head_tokens"], rag.knobs["check_layer"], rag.knobs["refine_layers"], rag.knobs["widen"]) == (
        blend.DEFAULT_HEAD_TOKENS, blend.DEFAULT_CHECK_LAYER, blend.DEFAULT_REFINE_LAYERS, blend.DEFAULT_WIDEN)
    rag.ingest(texts, PREFIX)
    ids, segs = rag.prompt(PREFIX, texts[::-1], QUESTION)
    conn = rag.connector
    recomputed = {f: conn.prefill_segments(ids, segs, **({} if f is None else {"fraction": f}))[2]
                  ["num_recomputed_tokens"] for f in (None, blend.DEFAULT_FRACTION, 0.5)}
    assert recomputed[None] == recomputed[blend.DEFAULT_FRACTION] < recomputed[0.5]


@torch.inference_mode()
def test_decode_grows_the_cache_it_is_given(smol, texts):
    rag = _rag(smol)
    out = rag.query(PREFIX, texts[:2], QUESTION)
    n = out.input_ids.shape[1]
    assert out.past.get_seq_length() == n
    new = rag.connector.decode(out.logits, out.past, n, max_new_tokens=4, eos_token_id=[])
    assert len(new) == 4 and out.past.get_seq_length() == n + 3  # the last new token is not fed back
