"""Run by the SGLang tests with the SGLang environment's python (``.venv-sglang``): SGLang's real storage parts.

Reads a JSON list of cases from argv[1]; each case builds a real host pool (``kvtier_harness.sglang_pools``: MHA or MLA,
``page_first`` or ``layer_first``) and a backend through SGLang's own factory (``dynamic`` + the case's extra
config), then runs its ops in order, calling the backend the way SGLang's cache controller does (batches of
``STORAGE_BATCH_SIZE`` pages, ``HiCacheStorageExtraInfo.prefix_keys``), and prints ``RESULT <json>``: per case,
per op, what the backend answered. The test asserts on it.

Ops: ``store`` (fill ``pages`` pages with random bytes of ``seed``, key them by SGLang's ``get_hash_str`` over
random tokens of ``tokens_seed``, ``batch_set_v1``; reports the keys, SGLang's event ids ``hash_str_to_int64`` and
the pages' SHA-256), ``exists`` / ``load`` (of ``keys``: ``batch_exists``, then ``batch_get_v1`` into fresh pool
slots; reports hits, per-page success and SHA-256), ``flat`` (the deprecated ``set`` / ``get`` / ``exists``),
``wait`` (prints ``WAIT`` and reads a line: the test acts on the server meanwhile), ``clear``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageExtraInfo

from kvtier_harness.sglang_pools import attach, fill_pages, hash_str_to_int64, mha_pool, mla_pool, page_bytes, page_keys
from kvtier_harness.sglang_pools import storage_config


def digests(pool, indices) -> list[str]:
    return [hashlib.sha256(b).hexdigest() for b in page_bytes(pool, indices)]


def batched(backend, call, keys, indices, page_size, pass_prefix):
    """``call(keys, indices, extra_info)`` per batch of ``STORAGE_BATCH_SIZE`` pages, results concatenated."""
    out, prefix = [], [] if pass_prefix else None
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i:i + STORAGE_BATCH_SIZE]
        out += call(batch, indices[i * page_size:(i + len(batch)) * page_size], HiCacheStorageExtraInfo(prefix_keys=prefix))
        if prefix is not None:
            prefix = prefix + batch
    return out


def exists(backend, keys, pass_prefix) -> int:
    """SGLang's ``_storage_hit_query``: batch by batch, stopping at the first short batch."""
    hits, prefix = 0, [] if pass_prefix else None
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i:i + STORAGE_BATCH_SIZE]
        n = backend.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=prefix))
        hits += n
        if n < len(batch):
            break
        if prefix is not None:
            prefix = prefix + batch
    return hits


def run_op(backend, pool, op: dict, state: dict) -> dict:
    page, kind = pool.page_size, op["op"]
    prefix = op.get("prefix_keys", True)
    started = time.monotonic()
    if kind == "store":
        n = op["pages"]
        tokens = torch.randint(0, 50_000, (n * page,), generator=torch.Generator().manual_seed(op["tokens_seed"])).tolist()
        keys = page_keys(tokens, page)
        indices = pool.alloc(n * page)
        fill_pages(pool, indices, op["seed"])
        stored = batched(backend, backend.batch_set_v1, keys, indices, page, prefix)
        state["keys"] = keys
        out = {"stored": stored, "keys": keys, "ids": [hash_str_to_int64(k) for k in keys],
               "sha": digests(pool, indices)}
        pool.free(indices)
    elif kind in ("exists", "load"):
        keys = op.get("keys") or state["keys"]
        out = {"exists": exists(backend, keys, prefix)}
        if kind == "load":
            indices = pool.alloc(len(keys) * page)
            pool.get_data_page(int(indices[0]), flat=False).fill_(0)
            out["loaded"] = batched(backend, backend.batch_get_v1, keys, indices, page, prefix)
            out["sha"] = digests(pool, indices)
            pool.free(indices)
    elif kind == "flat":
        keys = op.get("keys") or state["keys"]
        flat = [pool.get_dummy_flat_data_page().normal_() for _ in keys]
        out = {"set": [backend.set(k, v) for k, v in zip(keys, flat)], "exists": [backend.exists(k) for k in keys]}
        got = [backend.get(k, pool.get_dummy_flat_data_page()) for k in keys]
        got[0] = backend.get(keys[0])  # no target: the backend makes one
        out["equal"] = [g is not None and torch.equal(g.view(torch.uint8), v.view(torch.uint8)) for g, v in zip(got, flat)]
        out["sha"] = [hashlib.sha256(v.view(torch.uint8).numpy().tobytes()).hexdigest() for v in flat]
    elif kind == "wait":
        print("WAIT", flush=True)
        sys.stdin.readline()
        out = {}
    elif kind == "clear":
        out = {"cleared": backend.clear()}
    else:
        raise ValueError(f"unknown op {kind!r}")
    out["seconds"] = time.monotonic() - started
    return out


def make_pool(spec: dict):
    spec = dict(spec)
    kind, layout = spec.pop("kind"), spec.pop("layout")
    spec["dtype"] = getattr(torch, spec.pop("dtype", "bfloat16"))
    return (mla_pool if kind == "mla" else mha_pool)(layout, **spec)


def run_case(case: dict) -> dict:
    pool = make_pool(case["pool"])
    config = storage_config(case["extra"], mla=case["pool"]["kind"] == "mla",
                            page_first=case["pool"]["layout"] == "page_first", **case.get("storage", {}))
    try:
        backend = attach(case.get("backend", "dynamic"), config, pool)
    except Exception as exc:  # a refused configuration: what SGLang's attach would raise
        return {"error": type(exc).__name__, "message": str(exc)}
    state: dict = {}
    try:
        return {"ops": [run_op(backend, pool, op, state) for op in case.get("ops", [])]}
    finally:
        backend.close()


if __name__ == "__main__":
    print("RESULT " + json.dumps([run_case(case) for case in json.loads(sys.argv[1])]), flush=True)
