"""Identity: model and adapter identities, injective namespaces, per-block extra keys (vLLM 0.32's form)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.errors import InputError
from kvtier.extra_keys import block_extra_keys, check_extra_keys, event_extra_keys
from kvtier.hashing import prefix_hashes
from kvtier.identity import lora_identity, model_identity
from kvtier.keys import namespace_of
from kvtier.layout import KVLayout
from kvtier.demo.models import tiny_model

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4)


def in_subprocess(code: str) -> str:
    """stdout of ``code`` run by a fresh interpreter (another process: no shared caches)."""
    env = dict(os.environ, PYTHONHASHSEED="random")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


# ---- model identity ----------------------------------------------------------------------------------
def test_model_identity_is_the_weights_not_the_name(tmp_path):
    small, other_config = tmp_path / "a" / "default", tmp_path / "b" / "default"
    tiny_model(seed=0).save_pretrained(small)
    model = tiny_model(seed=0)
    model.config.rope_theta = 1234.0  # same weights and sizes, another config: another model
    model.save_pretrained(other_config)
    first = model_identity(small)
    assert first.startswith("default@") and len(first.split("@")[1]) == 16
    assert first != model_identity(other_config)
    assert first == model_identity(str(small)) == model_identity(tmp_path / "a" / ".." / "a" / "default")
    assert first != model_identity(small, revision="v2")
    # the same folder in another process: the same identity
    assert in_subprocess(f"from kvtier.identity import model_identity; print(model_identity({str(small)!r}))") == first
    # re-trained and saved over the old checkpoint: same path, config and file sizes, other weights
    tiny_model(seed=1).save_pretrained(small)
    assert model_identity(small) != first


def test_model_identity_of_a_gguf_file_a_repo_id_and_bad_folders(tmp_path):
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"GGUF" + bytes(200_000))
    one = model_identity(gguf)
    assert one.startswith("m.Q4.gguf@")
    gguf.write_bytes(b"GGUF" + bytes(199_999) + b"\x01")  # one byte changed, inside a sampled page
    assert model_identity(gguf) != one
    repo = model_identity("some-org/not-downloaded-model", revision="abc123")  # not cached here: id + revision
    assert repo.startswith("some-org/not-downloaded-model@")
    assert repo == model_identity("some-org/not-downloaded-model", revision="abc123")
    assert repo != model_identity("some-org/not-downloaded-model", revision="def456")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json and no weight files"):
        model_identity(tmp_path / "empty")
    with pytest.raises(InputError, match="must not be empty"):
        model_identity("")


# ---- LoRA identity and namespaces --------------------------------------------------------------------
def write_adapter(folder, weights: bytes):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (folder / "adapter_model.safetensors").write_bytes(weights)


def test_lora_identity_follows_the_adapter_files(tmp_path):
    adapter = tmp_path / "sql-lora"
    write_adapter(adapter, b"\x01" * 4096)
    first = lora_identity("sql", adapter)
    assert first.startswith("sql@")
    assert first != lora_identity("sql2", adapter) and first != lora_identity("sql", tmp_path / "elsewhere")
    code = f"from kvtier.identity import lora_identity; print(lora_identity('sql', {str(adapter)!r}))"
    assert in_subprocess(code) == first  # same adapter, same path, another process
    write_adapter(adapter, b"\x02" * 4096)  # re-trained: same name, same path, same size
    assert lora_identity("sql", adapter) != first
    assert lora_identity("hub", "org/adapter-on-the-hub") == lora_identity("hub", "org/adapter-on-the-hub")


def test_lora_identity_sees_a_rewrite_in_place_with_size_and_mtime_restored(tmp_path):
    adapter = tmp_path / "sql-lora"
    write_adapter(adapter, b"\x01" * 4096)
    weights = adapter / "adapter_model.safetensors"
    st = weights.stat()
    first = lora_identity("sql", adapter)  # caches the file's digest in this process
    time.sleep(0.05)  # past the kernel's timestamp granularity, so the rewrite's ctime differs
    with open(weights, "r+b") as f:  # same inode, same size
        f.write(b"\x03" * 4096)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back, as a copy tool would
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and weights.stat().st_size == st.st_size
    assert lora_identity("sql", adapter) != first


def test_namespace_is_injective_and_never_shows_the_salt():
    assert namespace_of() == namespace_of(None, None) == namespace_of("", "") == ""
    assert namespace_of("x;salt=y", None) != namespace_of("x", "y")  # was equal: joined strings
    assert namespace_of("x", None) != namespace_of(None, "x")
    ns = namespace_of("sql@0123", "secret-salt")
    assert len(ns) == 32 and int(ns, 16) >= 0 and "secret" not in ns
    assert ns == namespace_of("sql@0123", "secret-salt")


def test_a_retrained_adapter_misses_and_the_same_adapter_in_another_process_hits(tmp_path):
    adapter, disk = tmp_path / "adapter", tmp_path / "disk"
    write_adapter(adapter, b"\x05" * 4096)
    cfg = {"chunk_size": 8, "l1_size_gb": "1MiB", "l2_adapters": [{"type": "local_disk", "path": str(disk)}]}
    tokens = list(range(16))
    extra = block_extra_keys(16, 8, lora=("sql", str(adapter)))
    with KVCache(build_config(cfg), "base@1", LAYOUT) as cache:
        ns = namespace_of(lora_identity("sql", adapter))
        assert cache.store(tokens, torch.ones(LAYOUT.chunk_shape(16)), ns, extra_keys=extra) == 2
        cache.flush()
    code = f"""
        from kvtier.cache import KVCache
        from kvtier.config import build_config
        from kvtier.extra_keys import block_extra_keys
        from kvtier.identity import lora_identity
        from kvtier.keys import namespace_of
        from kvtier.layout import KVLayout
        cache = KVCache(build_config({cfg!r}), "base@1", KVLayout(1, 1, 4))
        ns = namespace_of(lora_identity("sql", {str(adapter)!r}))
        print(cache.lookup({tokens!r}, ns, extra_keys=block_extra_keys(16, 8, lora=("sql", {str(adapter)!r}))))
        cache.close()
    """
    assert in_subprocess(code) == "16"
    write_adapter(adapter, b"\x06" * 4096)  # re-trained and redeployed under the same name and path
    assert in_subprocess(code) == "0"


# ---- per-block extra keys ----------------------------------------------------------------------------
def test_block_extra_keys_build_vllms_tagged_form():
    keys = block_extra_keys(20, 8, lora=("sql", "/a/sql"), cache_salt="s", mm_items=[("img", 6, 4), ("aud", 17, 2)])
    assert keys == [
        (("lora", "sql", "/a/sql"), ("mm", "img", 6), ("cache_salt", "s")),  # lora, mm, salt (block 0 only)
        (("lora", "sql", "/a/sql"), ("mm", "img", -2)),  # an item continuing from block 0: offset < 0
        (("lora", "sql", "/a/sql"), ("mm", "aud", 1)),  # the partial last block counts
    ]
    assert block_extra_keys(20, 8) is None
    assert block_extra_keys(16, 8, prompt_embeds_digests=[b"a", b"b"]) == [(("prompt_embeds", b"a"),),
                                                                           (("prompt_embeds", b"b"),)]
    assert event_extra_keys(keys[0]) == ("sql", ("img", 6), "s")  # vLLM's untagged event form
    with pytest.raises(InputError, match="one per block"):
        block_extra_keys(16, 8, prompt_embeds_digests=[b"a"])


def test_same_placeholder_tokens_with_other_images_hash_differently():
    tokens = [7] * 16  # an image's placeholder tokens look the same for every image
    a = prefix_hashes(tokens, 8, extra_keys=block_extra_keys(16, 8, mm_items=[("image-a", 0, 16)]))
    b = prefix_hashes(tokens, 8, extra_keys=block_extra_keys(16, 8, mm_items=[("image-b", 0, 16)]))
    shifted = prefix_hashes(tokens, 8, extra_keys=block_extra_keys(16, 8, mm_items=[("image-a", 1, 15)]))
    assert len({a[0], b[0], shifted[0]}) == 3 and a[1] != b[1]


def test_check_extra_keys_rebuilds_tuples_and_refuses_bad_input():
    assert check_extra_keys(None, 3) is None and check_extra_keys([None, None], 2) is None
    got = check_extra_keys([[["lora", "a", "/p"]], None], 2)
    assert got == ((("lora", "a", "/p"),), None) and isinstance(got[0][0], tuple)
    for bad, message in [([[1.5], None], "float"), ([None], "exactly one per block"), ([[True], None], "bool"),
                         ([[], None], "non-empty"), ([["x" * 5000], None], "at most 4096"),
                         ([[2**70], None], "64 bits"), ("ab", "one entry per block"),
                         ([[[[[["deep"]]]]], None], "nested deeper"), ([[b"ok", object()], None], "object")]:
        with pytest.raises(InputError, match=message):
            check_extra_keys(bad, 2)


def test_cache_keys_include_extra_keys_and_their_memo(tmp_path):
    cfg = build_config({"chunk_size": 8, "block_size": 4, "l1_size_gb": "1MiB"})
    with KVCache(cfg, "m@1", LAYOUT) as cache:
        tokens = list(range(8))
        salted = block_extra_keys(8, 4, cache_salt="s")
        assert cache.store(tokens, torch.ones(LAYOUT.chunk_shape(8)), extra_keys=salted) == 1
        assert cache.lookup(tokens, extra_keys=salted) == 8
        assert cache.lookup(tokens) == 0  # the memo of the salted prompt is not reused without the salt
        assert cache.lookup(tokens, extra_keys=block_extra_keys(8, 4, cache_salt="t")) == 0
        (ref,) = cache.chunk_refs(tokens, extra_keys=salted)[1]
        assert ref.key.prefix_hash == prefix_hashes(tokens, 4, extra_keys=salted)[-1]  # its last block's digest
