"""kvtier's vLLM connector against the CUDA vLLM 0.33.0 and 0.34.0 wheels (``scripts/setup-vllm-wheels.sh`` keeps
their Python sources under ``.cache/vllm-wheels``; nothing is installed).

* The backend table of ``connectors.vllm_cuda_layouts`` is what each backend class says (name, packing, cache dtypes,
  kernel block sizes, read from its source) and ``KV_CACHE_LAYOUTS`` is vLLM's ``KVCacheLayout`` (its module run).
* ``vllm_cuda_layouts_oracle.py``: vLLM's own ``create_kv_cache_views`` allocates every backend's cache in every
  layout, fp16 / bf16 / fp8, whole and split kernel blocks; kvtier allocates the same tensors, gathers exactly the keys
  and values (or latent vectors) the backend's own expression reads, and scatters them back where it reads them.
* ``vllm_contract_oracle.py``: the real ``KVConnectorBase_V1`` of each wheel: no abstract method left, every
  signature compatible, ``kv_cache_access`` IN_PROCESS (0.34), no lookahead hashes.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from kvtier_harness.vllm import require_vllm

from kvtier.connectors.vllm_cuda_layouts import ATTENTION_BACKENDS, CACHE_DTYPES, KV_CACHE_LAYOUTS
from tests.support import vllm_wheels as wheels

HERE = Path(__file__).parent
KV_SPLIT = "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)"  # the kv packing's expression, as vLLM writes it
MLA_MODULE = "vllm/model_executor/layers/attention/mla_attention.py"


def run_oracle(script: str, version: str, *args: str) -> dict | list:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(VLLM_NO_USAGE_STATS="1", PYTHONPATH=os.pathsep.join(
        [str(wheels.root(version)), str(wheels.REPO / "src"), str(wheels.REPO)]))
    proc = subprocess.run([require_vllm(), str(HERE / script), *args], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ORACLE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("ORACLE "):])


def read_backends(version: str) -> dict[str, dict]:
    registry = wheels.registry(version)
    return {name: wheels.backend_facts(version, registry[name]) for name in ATTENTION_BACKENDS}


@pytest.mark.parametrize("version", wheels.VERSIONS)
def test_the_backend_table_is_what_each_backend_class_says(version):
    for name, facts in read_backends(version).items():
        ours = ATTENTION_BACKENDS[name]
        assert facts["name"] == name, facts["relpath"]
        assert ours.packing == ("latent" if "MLACommonBackend" in facts["bases"] else "kv"), name
        if ours.packing == "kv":  # keys then values along the content axis, in the backend's own forward
            assert KV_SPLIT in wheels.split_expressions(facts["module"]), name
        assert list(ours.kv_cache_dtypes) == [d for d in facts["kv_cache_dtypes"] if d in CACHE_DTYPES], name
        assert (set(ours.block_sizes), set(ours.block_multiples)) == (facts["block_sizes"], facts["block_multiples"]), name


@pytest.mark.parametrize("version", wheels.VERSIONS)
def test_mla_keeps_one_latent_vector_per_token(version):
    tree, text = wheels.parse(version, "vllm/v1/kv_cache_interface.py")
    spec = wheels.find_class(tree, "MLAAttentionSpec")
    head_size_v = next(s.value.value for s in spec.body if getattr(getattr(s, "target", None), "id", "") == "head_size_v")
    assert head_size_v == 0
    assert "kv_cache.squeeze(1)" in wheels.split_expressions(wheels.parse(version, MLA_MODULE)[1])


@pytest.mark.parametrize("version", wheels.VERSIONS)
def test_kv_cache_layouts_are_vllms(version):
    assert wheels.kv_cache_layouts(version) == KV_CACHE_LAYOUTS


@pytest.mark.parametrize("version", wheels.VERSIONS)
def test_every_backend_layout_dtype_and_block_split_round_trips_through_vllms_own_views(version):
    expressions = {name: KV_SPLIT if b.packing == "kv" else "kv_cache.squeeze(1)" for name, b in ATTENTION_BACKENDS.items()}
    registry = wheels.registry(version)
    got = run_oracle("vllm_cuda_layouts_oracle.py", version, json.dumps(expressions),
                     json.dumps({name: registry[name] for name in ATTENTION_BACKENDS}))
    rows, classes = got["rows"], got["classes"]
    # the classes that import on CPU say what their source says (the others are read from their source only)
    live = {name: c for name, c in classes.items() if "error" not in c}
    assert {"FLASH_ATTN", "TRITON_ATTN", "FLASHMLA", "TRITON_MLA"} <= set(live), classes
    for name, c in live.items():
        backend = ATTENTION_BACKENDS[name]
        assert c["name"] == name and c["mla"] == (backend.packing == "latent"), (name, c)
        assert list(backend.kv_cache_dtypes) == [d for d in c["kv_cache_dtypes"] if d in CACHE_DTYPES], (name, c)
    ran = [r for r in rows if "vllm_refused" not in r]
    # vLLM splits a block into kernel blocks only in layouts that keep a block's pages dense: nothing else to copy
    assert all(r["block_size"] != r["kernel"] for r in rows if "vllm_refused" in r)
    assert {(r["backend"], r["layout"]) for r in ran} == {(b, lay) for b in ATTENTION_BACKENDS for lay in KV_CACHE_LAYOUTS}
    assert {r["dtype"] for r in ran} == {"float16", "bfloat16", "fp8"}
    assert any(r["block_size"] != r["kernel"] for r in ran)
    for row in ran:
        assert row["nonzero"] and row["same_alloc"] and row["gather"] and row["scatter"] and row["untouched"], row
        assert row["stacked"], row  # vLLM places a tensor's layers a constant distance apart: one gather per chunk


@pytest.mark.parametrize("version", wheels.VERSIONS)
def test_the_connector_implements_the_wheels_connector_contract(version):
    got = run_oracle("vllm_contract_oracle.py", version)
    assert got["differ_detected"]
    for part in ("connector", "hma", "events"):
        assert got[part]["abstract"] and got[part]["left"] == [], (part, got[part])
        assert got[part]["implemented"] == got[part]["abstract"], (part, got[part])
        assert got[part]["mismatched"] == [], (part, got[part])
    assert got["lookahead"] is False
    if version >= "0.34":
        assert got["has_may_load_async"] and got["kv_cache_access"] == "IN_PROCESS"


@pytest.mark.parametrize("version", wheels.VERSIONS)
def test_every_abstract_method_is_defined_with_the_bases_parameters(version):
    """The same contract read from the source alone (no import): each abstract method of ``KVConnectorBase_V1`` and
    ``SupportsHMA`` has a definition in ``KVTierConnector`` with the base's parameter names, in order."""
    tree, _ = wheels.parse(version, wheels.CONNECTOR_BASE)
    ours = wheels.class_methods(wheels.parse_kvtier("src/kvtier/connectors/vllm.py"), "KVTierConnector")
    for cls in ("KVConnectorBase_V1", "SupportsHMA"):
        abstract = {n: f for n, (f, is_abstract) in wheels.class_methods(tree, cls).items() if is_abstract}
        assert abstract
        for name, fn in abstract.items():
            assert name in ours, (cls, name)
            theirs, mine = wheels.signature(fn), wheels.signature(ours[name][0])
            assert [p for p, _ in theirs["positional"]] == [p for p, _ in mine["positional"]], name
            assert (theirs["vararg"], theirs["kwarg"], theirs["decorators"]) == (
                mine["vararg"], mine["kwarg"], mine["decorators"]), name
