"""Which codec each L2 adapter writes with, and which lossy codecs a model's KV may be served from.

Why a policy: a lossy codec changes what the engine computes from the KV it loads, so it is part of the
answer's identity. ``lossy_codecs_allowed`` maps model ids or globs (``fnmatch``: ``"smollm2-*"``, ``"*"``) to
the lossy codec names (``Codec.name``, e.g. ``"fp8_e4m3+zstd"``) whose records may be served for that model;
the default, no entry, is lossless only. A lossless codec (``none``, ``zstd``, ``lz4``) is always allowed: its
decoded bytes are the bytes encoded.

Writers are checked too (``check_writer``): a tier configured to write a lossy codec for a model that may not
read it would fill with records nobody may serve, so the cache for that model refuses to open.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

from kvtier.codecs.base import Codec
from kvtier.codecs.registry import get_codec
from kvtier.errors import ConfigError


class CodecPolicy:
    """Per-adapter write codecs and the lossy codecs each model may be served from.

    Args:
        write_specs: one codec spec per L2 adapter, in cascade order (``"none"``, ``"lz4"``, ``"fp8_e4m3+zstd"``).
        lossy_allowed: ``lossy_codecs_allowed``: model id or glob -> lossy codec names.
        labels: the adapters' labels, for error messages.

    Raises:
        ConfigError (UnknownCodecError included): a spec that names no codec (the message lists the choices), or
            an allowed name that is not a lossy codec kvtier has.
    """

    def __init__(self, write_specs: Sequence[str], lossy_allowed: Mapping[str, Sequence[str]] | None = None,
                 labels: Sequence[str] | None = None) -> None:
        labels = list(labels or [f"adapter {i}" for i in range(len(write_specs))])
        self.codecs: list[Codec] = []
        for label, spec in zip(labels, write_specs):
            try:
                self.codecs.append(get_codec(spec))
            except ConfigError as exc:
                raise type(exc)(f"L2 adapter {label!r}: {exc}") from exc
        self.labels = labels
        self.lossy_allowed: dict[str, frozenset[str]] = {}
        for pattern, names in (lossy_allowed or {}).items():
            checked = set()
            for name in names:
                if isinstance(name, str) and ":" in name:
                    raise ConfigError(f"lossy_codecs_allowed[{pattern!r}]: {name!r}: list codec names without "
                                      f"options (e.g. {name.partition(':')[0]!r}): records name their options, and "
                                      "an allowed codec is served with any")
                try:
                    codec = get_codec(name)
                except ConfigError as exc:
                    raise type(exc)(f"lossy_codecs_allowed[{pattern!r}]: {exc}") from exc
                if codec.lossless:
                    raise ConfigError(f"lossy_codecs_allowed[{pattern!r}]: {name!r} is lossless and always allowed; "
                                      "list lossy codecs only (e.g. fp8_e4m3, int8, fp8_e4m3+zstd)")
                checked.add(codec.name)
            self.lossy_allowed[pattern] = frozenset(checked)

    def allowed(self, model: str, codec_name: str) -> bool:
        """Whether a record of ``model`` encoded with ``codec_name`` (a ``Codec.name``) may be served."""
        if get_codec(codec_name).lossless:
            return True
        return any(codec_name in names for pattern, names in self.lossy_allowed.items()
                   if fnmatch.fnmatchcase(model, pattern))

    def check_writer(self, model: str) -> None:
        """Raise ConfigError if an adapter writes a lossy codec that ``model`` may not be served from."""
        for label, codec in zip(self.labels, self.codecs):
            if not codec.lossless and not self.allowed(model, codec.name):
                raise ConfigError(f"L2 adapter {label!r} writes lossy codec {codec.name!r}, which model {model!r} may "
                                  f"not be served from; add it to lossy_codecs_allowed (e.g. {{{model!r}: "
                                  f"[{codec.name!r}]}}) or give that adapter a lossless codec (none, lz4, zstd)")

    def distinct(self) -> list[Codec]:
        """The distinct codecs the adapters write (each chunk is encoded once per codec)."""
        out: dict[str, Codec] = {}
        for codec in self.codecs:
            out.setdefault(codec.spec, codec)
        return list(out.values())
