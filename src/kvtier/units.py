"""Units of configuration values: sizes (``parse_size``) and booleans (``parse_bool``), as files, ``KVTIER_*``
variables and flags give them, and the pydantic types that read them (``SizeGB``, ``SizeBytes``, ``Bool``) with
the base of every configuration section (``StrictModel``): what ``kvtier.config`` and the L2 adapters' own
configs are made of. ``GB`` is 10**9 bytes: every ``*_size_gb`` in kvtier is decimal."""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar

import pydantic
from pydantic import BeforeValidator, Field

from kvtier.errors import ConfigError

GB = 10**9  # bytes in one GB of a ``*_size_gb`` value
_UNITS = {"": None, "b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": GB, "t": 10**12}
_SIZE_RE = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, default_unit: str = "GB") -> float:
    """Parse a size into a number of ``default_unit`` (GB by default).

    ``"5GB"``, ``"512MiB"``, ``"100B"``, ``"1.5"`` (bare: ``default_unit``), ``2`` (number: ``default_unit``).
    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) of 1024.

    Raises:
        ConfigError: negative, unparsable, or an unknown unit (valid units listed).
    """
    per_unit = _UNITS[default_unit.lower()]
    if isinstance(value, bool):
        raise ConfigError(f"size must be a number or a string like '5GB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), None
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError(f"cannot parse size {value!r}; write e.g. '5GB', '512MiB' or '1.5' (GB)")
        number, suffix = float(m.group(1)), m.group(2).lower()
        if suffix not in _UNITS:
            raise ConfigError(f"unknown size unit {m.group(2)!r} in {value!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
        unit = _UNITS[suffix]
    else:
        raise ConfigError(f"size must be a number or a string like '5GB', got {type(value).__name__}")
    if number < 0:
        raise ConfigError(f"size must not be negative, got {value!r}")
    return number if unit is None else number * unit / per_unit


def parse_bool(value: Any) -> bool:
    """``true/1/yes/on`` and ``false/0/no/off`` (any case), or a real bool. Raises ConfigError otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on", "y"):
        return True
    if text in ("false", "0", "no", "off", "n", ""):
        return False
    raise ConfigError(f"cannot read {value!r} as a boolean; use true/false, 1/0, yes/no or on/off")


def _as_value_error(fn):
    """Re-raise ConfigError as ValueError so pydantic attaches the key name to the message."""
    def wrapped(value):
        try:
            return fn(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    return wrapped


SizeGB = Annotated[float, BeforeValidator(_as_value_error(parse_size)), Field(ge=0)]
# a size in bytes: a bare number is bytes, a string may carry a unit ("64MiB", "5MB")
SizeBytes = Annotated[int, BeforeValidator(_as_value_error(lambda v: int(parse_size(v, "B")))), Field(ge=0)]
Bool = Annotated[bool, BeforeValidator(_as_value_error(parse_bool))]


_UNIT_NOTES = {("_ms", "_seconds"): "the value is now in seconds: divide the milliseconds by 1000",
               ("_mb", "_bytes"): "the value is now in bytes; a size such as '64MiB' also works"}


class RenamedKeyError(ValueError):
    """A configuration key given under a former name; the message names the new one."""


class StrictModel(pydantic.BaseModel):
    """A config section: unknown keys are refused, and so are former names (``renamed_fields``: old -> new,
    merged with the base classes') with a message naming the new key: a dropped setting would go unseen."""

    model_config = pydantic.ConfigDict(extra="forbid")
    renamed_fields: ClassVar[dict[str, str]] = {}

    @classmethod
    def renamed_keys(cls) -> dict[str, str]:
        """Former key -> new key, this section's ``renamed_fields`` merged with its base classes'."""
        renamed: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            renamed.update(vars(klass).get("renamed_fields", {}))
        return renamed

    @pydantic.model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            msgs = []
            for old, new in cls.renamed_keys().items():
                if old in data:
                    note = next((n for (a, b), n in _UNIT_NOTES.items() if old.endswith(a) and new.endswith(b)), "")
                    msgs.append(f"key {old!r} was renamed to {new!r}" + (f" ({note})" if note else ""))
            if msgs:
                raise RenamedKeyError("; ".join(msgs))
        return data
