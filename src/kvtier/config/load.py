"""Where the configuration comes from: a YAML file, ``KVTIER_*`` variables and explicit overrides.

Sources, in increasing priority: a YAML file (``KVTIER_CONFIG_FILE`` or ``--config``), ``KVTIER_*``
environment variables (nested keys joined by ``__``: ``KVTIER_KV_EVENTS__ENDPOINT``), then explicit
overrides (CLI flags). A ``KVTIER_*`` variable that names no key is a warning naming it (the environment holds
other tools' variables too: ``KVTIER_REPO``); an unknown key in a file or a flag stays an error. An
LMCache-style YAML file (``chunk_size``, ``local_cpu``, ``max_local_cpu_size``, ``local_disk``, ...) is
recognised and translated (``kvtier.config.lmcache``). Every error names the key and the nearest valid key.
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Any

import pydantic
import yaml

from kvtier.config.lmcache import from_lmcache
from kvtier.config.tree import KVTierConfig
from kvtier.units import RenamedKeyError, StrictModel
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

# KVTIER_* variables that are not configuration keys (tooling, tests, the model cache).
NON_CONFIG_ENV = {"KVTIER_CONFIG_FILE", "KVTIER_ADMIN_TOKEN", "KVTIER_AUTH_SECRET_FILE", "KVTIER_MODEL_CACHE", "KVTIER_SERVICES_DIR",
                  "KVTIER_AZURITE_BLOB", "KVTIER_VENV", "KVTIER_PYTHON", "KVTIER_FUZZ_MESSAGES"}


def _env_value(name: str, value: str) -> Any:
    """A variable's value: JSON/YAML when it starts with ``[`` or ``{`` (a list or mapping), else the text."""
    if not value.strip().startswith(("[", "{")):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at column {where.column + 1}" if where is not None else ""
        raise ConfigError(f"environment variable {name} is not valid JSON/YAML{at}: "
                          f"{getattr(exc, 'problem', None) or exc}; fix or unset it") from None


def _env_key_problem(path: list[str]) -> str | None:
    """Why a variable's key path names no configuration key (with the nearest key), or None when it does.
    Only sections are walked: below a field that is not a section (a list of adapters) pydantic checks."""
    if tuple(path) in _REMOVED:
        return None  # build_config refuses it, saying what to use instead
    model: type[StrictModel] = KVTierConfig
    for depth, part in enumerate(path):
        if part in model.renamed_keys():
            return None  # the section refuses it with a message naming the new key
        if part not in model.model_fields:
            return f"{'.'.join(path[:depth + 1])!r} is not a configuration key{_nearest(part, model)}"
        section = _subsection(model, part)
        if section is None:
            return None
        model = section
    return None


def _env_overrides(environ: dict[str, str]) -> dict:
    out: dict = {}
    for name, value in environ.items():
        if not name.startswith("KVTIER_") or name in NON_CONFIG_ENV:
            continue
        path = name[len("KVTIER_"):].lower().split("__")
        problem = _env_key_problem(path)
        if problem:
            log.warning("ignoring environment variable %s: %s (unset it, or rename it to the key's variable)",
                        name, problem)
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _env_value(name, value)
    if environ.get("KVTIER_ADMIN_TOKEN"):
        out.setdefault("server", {})["admin_token"] = environ["KVTIER_ADMIN_TOKEN"]
    if environ.get("KVTIER_AUTH_SECRET_FILE"):  # the same variable clients read
        out.setdefault("server", {})["auth_secret_file"] = environ["KVTIER_AUTH_SECRET_FILE"]
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and key in out and (not value or not isinstance(out[key], dict)):
            # flags of a section that the file gives as something else (``server: 5``): keep the file's value, so
            # that build_config refuses it rather than the section silently taking defaults
            continue
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _nearest(key: str, model: type[pydantic.BaseModel]) -> str:
    near = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.5)
    return f"; did you mean {near[0]!r}?" if near else f"; valid keys: {', '.join(model.model_fields)}"


def _subsection(model: type[pydantic.BaseModel], key: str) -> type[StrictModel] | None:
    """The section ``model.key`` is, or None when that key is not a section (a value, a list) or not a key."""
    ann = getattr(model.model_fields.get(key), "annotation", None)
    return ann if isinstance(ann, type) and issubclass(ann, StrictModel) else None


def _section_of(loc: tuple) -> type[pydantic.BaseModel]:
    model: type[pydantic.BaseModel] = KVTierConfig
    for part in loc[:-1]:
        model = _subsection(model, str(part)) or model
    return model


# removed key path -> what to use instead
_REMOVED = {("kv_events", "event_block_size"): "events are published per engine block of the top-level "
            "'block_size' (flag --block-size, variable KVTIER_BLOCK_SIZE); set that to the engine's block size",
            ("l2_promote",): "L2 hits are always copied into L1; remove the key (l2_promote_to_faster_l2 "
            "also copies them into faster L2 adapters)"}


def build_config(data: dict) -> KVTierConfig:
    """Validate a plain dict (already merged from every source) into a KVTierConfig.

    Raises:
        ConfigError: naming the offending key, what was wrong, and the nearest valid key.
    """
    for path, instead in _REMOVED.items():
        node = data
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            raise ConfigError(f"invalid configuration: key '{'.'.join(path)}' was removed: {instead}")
    try:
        return KVTierConfig(**data)
    except pydantic.ValidationError as exc:
        msgs = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            key = ".".join(str(p) for p in loc)
            if err["type"] == "extra_forbidden":
                msgs.append(f"unknown key {key!r}{_nearest(str(loc[-1]), _section_of(loc))}")
            else:
                cause = err.get("ctx", {}).get("error")  # kvtier's own validators already quote the value
                if not key:  # a check across keys (block_size vs chunk_size): its message names them
                    msgs.append(str(cause or err["msg"]))
                elif isinstance(cause, RenamedKeyError):  # raised by the section, so loc is the section
                    msgs.append(f"in section {key!r}: {cause}")
                else:
                    msgs.append(f"key {key!r}: {cause}" if cause else f"key {key!r}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("invalid configuration: " + "; ".join(msgs)) from None


def load_config(path: str | os.PathLike | None = None, overrides: dict | None = None,
                environ: dict[str, str] | None = None) -> KVTierConfig:
    """Load the configuration: YAML file < ``KVTIER_*`` environment < ``overrides`` (CLI flags).

    Args:
        path: YAML file; defaults to ``$KVTIER_CONFIG_FILE`` when set. kvtier or LMCache keys.
        overrides: explicit values (flags); ``None`` values are ignored.
        environ: environment to read (default ``os.environ``).

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or bad value.
    """
    environ = dict(os.environ if environ is None else environ)
    path = path or environ.get("KVTIER_CONFIG_FILE")
    data: dict = {}
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
        data = from_lmcache(data)
    data = _merge(data, _env_overrides(environ))
    data = _merge(data, _drop_none(overrides or {}))
    return build_config(data)


def _drop_none(d: dict) -> dict:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}
