"""Distinct real texts for the vLLM benchmarks, read offline from what Debian ships.

The corpus is the licence texts in ``/usr/share/common-licenses`` and the documentation Debian packages install
under ``/usr/share/doc`` (``README*``, ``NEWS*``, ``changelog*``, ``copyright``, ``AUTHORS*``, ``TODO*``,
``THANKS*``; ``.gz`` files are decompressed; files that are not UTF-8 are skipped). Paths are sorted and then
shuffled with a seed, so a seed picks the same texts on the same machine.

Every paragraph (a blank-line separated block, compared with its whitespace collapsed) is used at most once
across all the texts drawn from one ``Corpus``: the licence boilerplate that hundreds of ``copyright`` files
repeat appears once, and no two drawn texts share a paragraph. That is what makes the benchmark's working set
honest: each user's context is KV that nobody else can reuse.
"""

from __future__ import annotations

import gzip
import hashlib
import random
from collections.abc import Iterator
from pathlib import Path

LICENSES = Path("/usr/share/common-licenses")
DOCS = Path("/usr/share/doc")
DOC_STEMS = ("readme", "news", "changelog", "copyright", "authors", "todo", "thanks")
SKIP_SUFFIXES = (".html", ".htm", ".pdf", ".png", ".svg", ".jpg", ".css", ".js", ".json", ".xml")


class CorpusExhausted(ValueError):
    """The offline corpus holds less distinct text than the configuration asks for."""


def candidate_files(folder: Path | None = None) -> list[Path]:
    """The corpus files, sorted by path (symbolic links skipped): every file under ``folder`` when given, else the
    licences and the package documentation files named above."""
    roots = (folder,) if folder else (LICENSES, DOCS)
    out = []
    for root in roots:
        if not root.is_dir():
            continue
        for path in root.rglob("*"):
            if path.is_symlink() or not path.is_file():
                continue
            name = path.name.lower().removesuffix(".gz")
            if root in (folder, LICENSES) or (name.startswith(DOC_STEMS) and not name.endswith(SKIP_SUFFIXES)):
                out.append(path)
    return sorted(out)


def read_text(path: Path) -> str | None:
    """The file as text (gunzipped when it ends in ``.gz``), or None when it is not UTF-8 text."""
    try:
        data = path.read_bytes()
        if path.name.endswith(".gz"):
            data = gzip.decompress(data)
        text = data.decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError):
        return None
    return None if "\x00" in text else text


class Corpus:
    """Draws texts of a given token length from the shuffled corpus; no paragraph is ever drawn twice.

    ``tokenizer`` is a Hugging Face tokenizer (the served model's own, so lengths are the engine's).
    """

    def __init__(self, tokenizer, seed: int, files: list[Path] | None = None):
        self.tokenizer = tokenizer
        self.files = list(files if files is not None else candidate_files())
        random.Random(seed).shuffle(self.files)
        self._next_file = iter(self.files)
        self._seen: set[bytes] = set()
        self.sources: list[list[str]] = []  # per drawn text, the files it came from

    def _paragraphs(self) -> Iterator[tuple[str, str]]:
        """Paragraphs of the files not opened yet, file after file (a draw starts with a fresh file)."""
        for path in self._next_file:
            text = read_text(path)
            if text is None:
                continue
            for para in text.split("\n\n"):
                if para.strip():
                    yield str(path), para.strip("\n")

    def draw(self, num_tokens: int) -> str:
        """Text of ``num_tokens`` tokens from paragraphs never drawn before, starting with a file not opened yet.

        The rest of the last file it reads is left unused. Raises ``CorpusExhausted`` when the corpus has no
        more files.
        """
        parts: list[str] = []
        have = 0
        sources: list[str] = []
        for path, para in self._paragraphs():
            key = hashlib.sha256(" ".join(para.split()).encode()).digest()
            if key in self._seen:
                continue
            self._seen.add(key)
            parts.append(para)
            if not sources or sources[-1] != path:
                sources.append(path)
            have += len(self.tokenizer(para + "\n\n", add_special_tokens=False).input_ids)
            if have >= num_tokens:
                break
        else:
            raise CorpusExhausted(f"the corpus ({len(self.files)} files) ran out of distinct text after "
                                  f"{len(self.sources)} texts, drawing one of {num_tokens} tokens")
        ids = self.tokenizer("\n\n".join(parts), add_special_tokens=False).input_ids[:num_tokens]
        self.sources.append(sources)
        # a cut inside a multi-byte character decodes to U+FFFD: drop it rather than send it
        return self.tokenizer.decode(ids).replace("\ufffd", "")
