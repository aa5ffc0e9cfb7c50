"""The documents and questions of ``benchmarks/rag_blend.py``: two document sets and extraction questions with gold
answers, read offline.

Document sets:
  debian   texts Debian ships (``corpus.Corpus``: licences, package READMEs, changelogs; no paragraph twice)
  pydoc    the Python standard library's reference, as ``pydoc`` renders it in plain text (one module per
           document, its "MODULE REFERENCE" boilerplate dropped)

Extraction questions: "Continue this text from the documents.", the answer started with the eight words (as
written) that come before the gold answer in one document, so the answer's first word is the gold. The gold
answer is a word (letters only, at least 5 of them) found, as a whole word, in **exactly one** document of the
set, and its eight-word lead-in occurs exactly once in all the documents, so the question has one answer, found
in one place; both are checked when the set is built. An answer is correct when its first word is the gold
(any case). (Asked as "Which word comes after ...?", SmolLM2-135M answers 0 of 6 from a full prefill; continuing
the quoted lead-in, 5 of 6.)
"""

from __future__ import annotations

import importlib
import pydoc
import random
import re

from corpus import Corpus

PYDOC_MODULES = ("difflib", "csv", "base64", "calendar", "zipfile", "gzip", "statistics", "ipaddress", "secrets",
                 "queue", "uuid", "textwrap", "fractions", "sched", "heapq", "string")
CONTEXT_WORDS = 8
OPEN = "Continue this text from the documents."
MIN_ANSWER_LETTERS = 5
WORD = re.compile(r"[A-Za-z]+")


def pydoc_texts(tokenizer, lengths: list[int], seed: int) -> list[str]:
    """One text per length, each a standard-library module's plain-text reference cut to that many tokens (modules
    in a seeded shuffle)."""
    modules = list(PYDOC_MODULES)
    random.Random(seed).shuffle(modules)
    if len(lengths) > len(modules):
        raise ValueError(f"the pydoc set has {len(modules)} modules, {len(lengths)} documents asked for")
    out = []
    for name, n in zip(modules, lengths):
        text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        text = re.sub(r"MODULE REFERENCE\n.*?\n\n(?=[A-Z]+\n)", "", text, flags=re.S)  # the same in every module
        ids = tokenizer(text, add_special_tokens=False).input_ids[:n]
        out.append(tokenizer.decode(ids).replace("\ufffd", ""))
    return out


def document_texts(tokenizer, docset: str, lengths: list[int], seed: int) -> list[str]:
    """The texts of a document set (``debian`` or ``pydoc``), one per length in tokens."""
    if docset == "pydoc":
        return pydoc_texts(tokenizer, lengths, seed)
    corpus = Corpus(tokenizer, seed)
    return [corpus.draw(n) for n in lengths]


def _words(text: str) -> list[tuple[str, int]]:
    return [(m.group(0), m.start()) for m in WORD.finditer(text)]


def extraction_questions(texts: list[str]) -> list[list[tuple[str, str]]]:
    """Per document, its ``(lead-in, gold answer)`` pairs (see the module docstring), checked: the answer is found
    in that document only, its lead-in exactly once in all documents (compared word by word), and the answer is not
    in its lead-in. The lead-in is the document's own text (its whitespace and punctuation), so it tokenizes as in
    the document."""
    lowered = [t.lower() for t in texts]
    joined = "\n".join(" ".join(w.lower() for w, _ in _words(t)) for t in texts)
    out = []
    for d, text in enumerate(texts):
        found = _words(text)
        words = [w for w, _ in found]
        pairs, seen = [], set()
        for j in range(CONTEXT_WORDS, len(words)):
            gold = words[j]
            if len(gold) < MIN_ANSWER_LETTERS or gold.lower() in seen:
                continue
            pattern = re.compile(rf"\b{re.escape(gold.lower())}\b")
            if [bool(pattern.search(t)) for t in lowered].count(True) != 1 or not pattern.search(lowered[d]):
                continue
            if joined.count(" ".join(words[j - CONTEXT_WORDS:j]).lower()) != 1:
                continue
            lead = text[found[j - CONTEXT_WORDS][1]:found[j][1]].rstrip()
            if pattern.search(lead.lower()):
                continue
            seen.add(gold.lower())
            pairs.append((lead, gold))
        out.append(pairs)
    return out


def answered(answer: str, gold: str) -> bool:
    """Whether the first word of ``answer`` is ``gold`` (any case)."""
    first = WORD.search(answer)
    return first is not None and first.group(0).lower() == gold.lower()
