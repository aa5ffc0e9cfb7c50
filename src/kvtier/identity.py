"""Identity of what computes the KV: the weights and the LoRA adapters, as keys need them.

- ``model_identity``: the weights' identity (never a served name), the ``model`` of every ``ChunkKey``.
- ``lora_identity``: an adapter's identity (name, path and a digest of its files), for ``keys.namespace_of``.

What else enters a block's hash (LoRA, salt, multimodal items) is ``kvtier.extra_keys``.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import cbor2

from kvtier.errors import InputError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLE_HEAD_BYTES = 1 << 16  # every weight file's first bytes (safetensors / GGUF headers) ...
SAMPLE_BYTES, MAX_SAMPLES = 4096, 256  # ... and this many bytes at up to this many evenly spaced offsets


def _digest16(obj) -> str:
    """16 hex chars of SHA-256 over the canonical CBOR of ``obj``."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).hexdigest()[:16]


def model_identity(path_or_repo_id: str | os.PathLike, revision: str | None = None, *, extra: str | None = None) -> str:
    """The identity of a model's weights: ``"<name>@<16 hex>"``, the ``model`` field of every chunk key.

    The digest covers the resolved local path (or the hub repo id), ``revision``, a digest of ``config.json``
    and the names and sizes of the weight files (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.gguf``), for a
    model folder or a single weight file (a GGUF), plus a sample of each weight file's bytes (its first
    64 KiB and 4 KiB at up to 256 evenly spaced offsets: about 1 MiB read per file, whatever its size), so a
    checkpoint re-trained and saved over the old one (same path, config and sizes) gets a new identity too.
    Every process loading the same files agrees. A repo id that is not a local path is looked up in the
    local Hugging Face cache (``huggingface_hub``, no download); when absent there the digest covers the repo
    id and ``revision`` only (pin ``revision`` to a commit then). To share chunks between machines that keep
    the same weights under different paths, give every engine the same explicit model id instead
    (``kvtier.model``), and change it whenever the weights change. ``extra``: anything else that changes
    what the weights compute (an engine's effective model config, with its overrides), hashed along.

    Raises:
        InputError: an empty id, or a local folder that holds no ``config.json`` and no weight files.
    """
    text = os.fspath(path_or_repo_id)
    if not text:
        raise InputError("model path or repo id must not be empty")
    local = Path(text).expanduser()
    if local.exists():
        local = local.resolve()
        return f"{local.name}@{_digest16([*_files_identity(local, str(local), revision), extra])}"
    snapshot = _hub_snapshot(text, revision)
    if snapshot is not None:  # the same commit in any cache path: name it by repo id and commit
        return f"{text}@{_digest16([*_files_identity(snapshot, text, snapshot.name), extra])}"
    return f"{text}@{_digest16(['kvtier-model-v1', text, revision, None, [], extra])}"


def _files_identity(local: Path, source: str, revision: str | None) -> list:
    if local.is_file():
        return ["kvtier-model-v1", source, revision, None, [[local.name, *_weights_sample(local)]]]
    config = local / "config.json"
    config_digest = hashlib.sha256(config.read_bytes()).digest() if config.is_file() else None
    weights = sorted([p.relative_to(local).as_posix(), *_weights_sample(p)] for p in local.rglob("*")
                     if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if config_digest is None and not weights:
        raise InputError(f"{local} holds no config.json and no weight files ({', '.join(WEIGHT_SUFFIXES)}); "
                         "pass the model folder, a GGUF file, a hub repo id, or an explicit model id")
    return ["kvtier-model-v1", source, revision, config_digest, weights]


def _weights_sample(path: Path) -> list:
    """``[size, digest of the sampled bytes]`` of one weight file (offsets depend on the size only)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE_HEAD_BYTES))
        count = min(MAX_SAMPLES, max(0, size - SAMPLE_HEAD_BYTES) // SAMPLE_BYTES)
        for k in range(count):
            f.seek(SAMPLE_HEAD_BYTES + (size - SAMPLE_HEAD_BYTES - SAMPLE_BYTES) * k // max(1, count - 1))
            h.update(f.read(SAMPLE_BYTES))
    return [size, h.digest()]


def _hub_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of a hub repo (no network), or None."""
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 -- not installed, not cached, not a repo id: identity from the id alone
        return None


def lora_identity(name: str, path: str | os.PathLike | None = None) -> str:
    """A LoRA adapter's identity: ``"<name>@<16 hex>"`` over the name, the path and a digest of the adapter's
    files where they are readable (every regular file under ``path``, or the file ``path``).

    The same adapter at the same path gives the same identity in every process; an adapter re-trained under
    the same name and path gives a new one. File digests are cached per process by (path, device, inode, size,
    mtime_ns, ctime_ns): a file rewritten in place, even with its size and mtime restored, changes its ctime.
    A ``path`` that is not readable here (e.g. a hub id) contributes its text only.

    Raises:
        InputError: an empty name.
    """
    if not isinstance(name, str) or not name:
        raise InputError(f"LoRA name must be a non-empty string, got {name!r}")
    path_text = None if path is None else os.fspath(path)
    return f"{name}@{_digest16(['kvtier-lora-v1', name, path_text, _adapter_digest(path_text)])}"


def _adapter_digest(path: str | None) -> bytes | None:
    if not path:
        return None
    root = Path(path).expanduser()
    try:
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(root).parts))
        else:
            return None
        parts = []
        for f in files:
            st = f.stat()
            parts.append([f.name if f == root else f.relative_to(root).as_posix(),
                          _file_digest(str(f.resolve()), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                                          st.st_ctime_ns))])
    except OSError:
        return None
    return hashlib.sha256(cbor2.dumps(parts, canonical=True)).digest()


@functools.lru_cache(maxsize=4096)
def _file_digest(path: str, stat_key: tuple) -> bytes:  # stat_key: only the cache key
    # ctime cannot be set by a user (utime, write and rename all move it), so a changed file never keeps its key
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()
