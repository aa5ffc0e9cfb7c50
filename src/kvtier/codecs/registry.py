"""Codec names -> codecs.

A spec is ``[transform][+compressor]``, each stage ``name`` or ``name:option=value,option=value``:
``none``, ``zstd``, ``lz4:acceleration=4``, ``fp8_e4m3``, ``int8:scale=kivi,group=64``, ``bf16+zstd``,
``fp8_e4m3:scale=token+zstd:level=3``. Values that look like integers are integers.
"""

from __future__ import annotations

import functools

from kvtier.codecs.base import Codec
from kvtier.codecs.blosc import BloscLz4, BloscZstd
from kvtier.codecs.compressors import SHUFFLES, Lz4, Zstd
from kvtier.codecs.quantize import SCALE_MODES, Bf16, Fp8E4M3, Int8
from kvtier.errors import ConfigError, UnknownCodecError

TRANSFORMS = {cls.name: cls for cls in (Fp8E4M3, Int8, Bf16)}
COMPRESSORS = {cls.name: cls for cls in (Zstd, Lz4, BloscZstd, BloscLz4)}
# option -> allowed values (None: any integer in the range)
_CHOICES = {"shuffle": SHUFFLES, "scale": SCALE_MODES}
_RANGES = {"level": (-7, 22), "acceleration": (1, 65537), "group": (0, 1 << 20), "sink": (0, 1 << 20), "center": (0, 1),
           "span": (0, 1 << 20)}


def codec_names() -> list[str]:
    """The stage names a spec may use, plus ``none``."""
    return ["none", *TRANSFORMS, *COMPRESSORS]


def _choices_text() -> str:
    return (f"'none', a transform {sorted(TRANSFORMS)}, a compressor {sorted(COMPRESSORS)}, or "
            "'<transform>+<compressor>' (e.g. 'fp8_e4m3+zstd')")


def _value(text: str):
    try:
        return int(text)
    except ValueError:
        return text


def _stage(text: str, spec: str):
    name, _, opts = text.partition(":")
    if name == "none":
        raise ConfigError(f"codec {spec!r}: 'none' stands alone (no options, no other stage)")
    cls = TRANSFORMS.get(name) or COMPRESSORS.get(name)
    if cls is None:
        raise UnknownCodecError(f"unknown codec {name!r} in {spec!r}; use {_choices_text()}")
    options = {}
    for item in filter(None, opts.split(",")):
        key, eq, raw = item.partition("=")
        if not eq or key not in cls.OPTIONS:
            raise ConfigError(f"codec {name!r} in {spec!r}: bad option {item!r}; its options are "
                              f"{sorted(cls.OPTIONS) or 'none'} (as {name}:option=value,...)")
        if key in options:
            raise ConfigError(f"codec {name!r} in {spec!r}: option {key!r} given twice")
        value = _value(raw)
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ConfigError(f"codec {name!r} in {spec!r}: {key}={raw!r}; use one of {_CHOICES[key]}")
        if key in _RANGES:
            low, high = _RANGES[key]
            if not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"codec {name!r} in {spec!r}: {key}={raw!r}; use an integer in [{low}, {high}]")
        options[key] = value
    return cls(**options)


@functools.lru_cache(maxsize=64)
def get_codec(spec: str) -> Codec:
    """The codec a spec names (one shared instance per spec; codecs are safe to use from several threads).

    Raises:
        UnknownCodecError (a ConfigError): a stage name kvtier does not have; the message lists the choices.
        ConfigError: a bad option, or stages in a wrong order (a transform first, then a compressor, one each).
    """
    if not isinstance(spec, str):
        raise UnknownCodecError(f"a codec spec must be a string, got {spec!r}; use {_choices_text()}")
    text = spec.strip()
    if text == "none":
        return Codec()
    stages = [_stage(part.strip(), spec) for part in text.split("+")]
    transforms = [s for s in stages if s.name in TRANSFORMS]
    compressors = [s for s in stages if s.name in COMPRESSORS]
    if len(transforms) > 1 or len(compressors) > 1 or (transforms and stages[0] is not transforms[0]):
        raise ConfigError(f"codec {spec!r}: write at most one transform {sorted(TRANSFORMS)} followed by at most "
                          f"one compressor {sorted(COMPRESSORS)}, e.g. 'fp8_e4m3+zstd'")
    return Codec(transforms[0] if transforms else None, compressors[0] if compressors else None)
