"""KV codecs per L2 adapter (issue 20 part B) on a real local disk and a real redis-server: records written
encoded, read back into the same KV (lossless) or close KV (lossy, where allowed), bytes counted per codec,
lossy records refused for models that may not be served from them, and writers refused for such models."""

from __future__ import annotations

import pytest
import torch
import xxhash
from support.server import CHUNK, LAYOUT

from kvtier_harness import services

from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.record import decode_header, encode_record


@pytest.fixture(scope="module")
def redis_service(tmp_path_factory):
    with services.redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


def bf16_like(n_tokens: int, seed: int) -> torch.Tensor:
    """fp32 KV whose values are bf16 numbers, as a bf16 model's KV widened to fp32 is."""
    kv = torch.randn(LAYOUT.chunk_shape(n_tokens), generator=torch.Generator().manual_seed(seed))
    return kv.to(torch.bfloat16).to(torch.float32)


def config(adapters: list[dict], **extra) -> dict:
    return build_config({"chunk_size": CHUNK, "l1_size_gb": "64MiB", "l2_adapters": adapters, **extra})


def test_each_adapter_writes_its_codec_and_reads_it_back(tmp_path, redis_service):
    disk = {"type": "local_disk", "path": str(tmp_path / "disk"), "codec": "zstd"}
    redis = {"type": "redis", "url": redis_service.url, "prefix": f"{tmp_path.name}:", "codec": "fp8_e4m3+zstd"}
    cfg = config([disk, redis], lossy_codecs_allowed={"m*": ["fp8_e4m3+zstd"]})
    tokens = list(range(4 * CHUNK))
    kv = bf16_like(len(tokens), 1)
    with KVCache(cfg, "m1", LAYOUT) as writer:
        assert writer.store(tokens, kv) == 4 and writer.flush(30.0)
        m = writer.metrics
        raw_disk = m.value("kvtier_l2_raw_bytes_written_total", adapter="local_disk", codec="zstd")
        assert raw_disk == kv.numel() * 4
        assert m.value("kvtier_l2_bytes_written_total", adapter="local_disk", codec="zstd") < raw_disk / 1.3
        fp8 = m.value("kvtier_l2_bytes_written_total", adapter="redis", codec="fp8_e4m3+zstd")
        # fp32 -> fp8 plus zstd; these test chunks are small, so the record headers weigh in (the benchmark
        # measures real chunks)
        assert fp8 < raw_disk / 2
        assert m.value("kvtier_l2_compression_ratio", adapter="redis", codec="fp8_e4m3+zstd") == raw_disk / fp8
        status = {row["name"]: row for row in writer.l2.status()}  # what /status shows per L2 adapter
        assert status["redis"]["codec"].startswith("fp8_e4m3") and status["redis"]["raw_bytes_written"] == raw_disk
        assert status["local_disk"]["ratio"] > 1.3 and status["local_disk"]["bytes_written"] < raw_disk
    with KVCache(config([disk]), "m1", LAYOUT) as disk_only:  # lossless: exactly the KV stored
        out, n = disk_only.retrieve(tokens)
        assert n == len(tokens) and torch.equal(out, kv)
    with KVCache(config([redis], lossy_codecs_allowed={"m1": ["fp8_e4m3+zstd"]}), "m1", LAYOUT) as lossy:
        out, n = lossy.retrieve(tokens)
        assert n == len(tokens) and torch.allclose(out, kv, rtol=0.13, atol=0.02) and not torch.equal(out, kv)
    # default (lossless only): a reader of the same records refuses them, keeps them, counts them
    with KVCache(config([{**redis, "codec": "none"}]), "m1", LAYOUT) as strict:
        assert strict.retrieve(tokens)[1] == 0 and strict.lookup(tokens) == 0
        assert strict.metrics.value("kvtier_l2_lossy_refused_total", adapter="redis") >= 1
    with KVCache(config([redis], lossy_codecs_allowed={"m1": ["fp8_e4m3+zstd"]}), "m1", LAYOUT) as again:
        assert again.retrieve(tokens)[1] == len(tokens)  # kept: still there for who may read them


def test_bad_codec_settings_are_startup_errors(tmp_path):
    disk = {"type": "local_disk", "path": str(tmp_path / "disk")}
    with pytest.raises(ConfigError, match="unknown codec 'lz5'.*'none'"):
        KVCache(config([{**disk, "codec": "lz5"}]), "m", LAYOUT)
    with pytest.raises(ConfigError, match="writes lossy codec 'int8', which model 'other' may not"):
        KVCache(config([{**disk, "codec": "int8"}], lossy_codecs_allowed={"m": ["int8"]}), "other", LAYOUT)


def test_a_server_refuses_the_clients_of_a_model_its_lossy_writer_may_not_serve_and_says_so(tmp_path):
    from support.server import ServerProc

    from kvtier.client import Client
    from kvtier.errors import ProtocolError

    disk = {"type": "local_disk", "path": str(tmp_path / "disk"), "codec": "int8"}
    with ServerProc(tmp_path, config={"l2_adapters": [disk], "lossy_codecs_allowed": {"m": ["int8"]}}) as server:
        for _ in range(2):
            with pytest.raises(ProtocolError, match="writes lossy codec 'int8', which model 'other' may not"):
                Client(server.url, model="other", layout=LAYOUT).close()
        with Client(server.url, model="m", layout=LAYOUT) as allowed:
            assert allowed.store(list(range(CHUNK)), bf16_like(CHUNK, 5)) == 1
        log = server.log_path.read_text()
        assert log.count("WARNING kvtier.server.connections: refusing clients of model 'other'") == 1, log[-2000:]


def test_a_corrupted_compressed_record_is_a_miss_deleted_and_counted(tmp_path):
    disk = {"type": "local_disk", "path": str(tmp_path / "disk"), "codec": "lz4"}
    tokens = list(range(CHUNK))
    with KVCache(config([disk]), "m", LAYOUT) as writer:
        assert writer.store(tokens, bf16_like(CHUNK, 2)) == 1 and writer.flush(30.0)
    files = [p for p in (tmp_path / "disk").rglob("*") if p.is_file() and p.stat().st_size > 1000]
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[0].write_bytes(bytes(data))
    with KVCache(config([disk]), "m", LAYOUT) as reader:
        assert reader.retrieve(tokens)[1] == 0
        assert reader.metrics.value("kvtier_corrupt_records_total", adapter="local_disk") == 1
        assert reader.lookup(tokens) == 0  # deleted


@pytest.mark.parametrize("field, damaged", [(b"\xa5group\x10", b"\xa5group\x11"), (b"float32", b"float33")])
def test_a_damaged_record_header_is_a_miss_deleted_and_counted(tmp_path, field, damaged):
    """The header says how to decode the payload: a codec option (int8's key group 16 -> 17) or the layout (its
    dtype) damaged on disk must be a corrupt record, never KV decoded with other parameters nor an error."""
    disk = {"type": "local_disk", "path": str(tmp_path / "disk"), "codec": "int8"}
    allowed = {"lossy_codecs_allowed": {"m": ["int8"]}}
    tokens = list(range(CHUNK))
    with KVCache(config([disk], **allowed), "m", LAYOUT) as writer:
        assert writer.store(tokens, bf16_like(CHUNK, 4)) == 1 and writer.flush(30.0)
    (path,) = [p for p in (tmp_path / "disk").rglob("*") if p.is_file() and field in p.read_bytes()]
    path.write_bytes(path.read_bytes().replace(field, damaged, 1))
    with KVCache(config([disk], **allowed), "m", LAYOUT) as reader:
        assert reader.retrieve(tokens)[1] == 0
        assert reader.metrics.value("kvtier_corrupt_records_total", adapter="local_disk") == 1
        assert not path.exists() and reader.lookup(tokens) == 0


class _GarbageLz4:
    """Fault injection around the real lz4 codec: its parameters and checksum, over bytes that are not an lz4
    block, so the record verifies and only the decoder can tell."""

    name = "lz4"

    def encode(self, payload, layout, num_tokens):
        from kvtier.codecs import Encoded, get_codec

        real = get_codec("lz4").encode(payload, layout, num_tokens)
        garbage = bytes(b ^ 0x5A for b in memoryview(real.data).cast("B"))
        return Encoded(garbage, {**real.params, "xxh3": xxhash.xxh3_64_intdigest(garbage)})


def test_a_record_that_verifies_but_does_not_decode_is_a_miss_deleted_and_counted(tmp_path):
    """Decoding happens in the L1 slot a promotion reserved: a failing decoder leaves no chunk there (the
    reservation is given back), the record is deleted and counted, and the prefix stops before it."""
    disk = {"type": "local_disk", "path": str(tmp_path / "disk"), "codec": "lz4"}
    tokens = list(range(2 * CHUNK))
    kv = bf16_like(2 * CHUNK, 3)
    with KVCache(config([disk]), "m", LAYOUT) as writer:
        assert writer.store(tokens, kv) == 2 and writer.flush(30.0)
    files = sorted((p for p in (tmp_path / "disk").rglob("*") if p.is_file() and p.stat().st_size > 1000),
                   key=lambda p: p.stat().st_mtime_ns)
    assert len(files) == 2
    for path in files:
        header, _ = decode_header(path.read_bytes())
        if header.token_ids == tokens[CHUNK:]:  # the second chunk's record becomes undecodable
            layout = KVLayout.from_dict(header.layout)
            parts = encode_record(header.key, layout, header.token_ids, kv[:, :, CHUNK:].contiguous().numpy(),
                                  codec=_GarbageLz4())
            path.write_bytes(b"".join(bytes(p) for p in parts))
    with KVCache(config([disk]), "m", LAYOUT) as reader:
        found, hits = reader.retrieve(tokens)
        assert hits == CHUNK and torch.equal(found[:, :, :CHUNK], kv[:, :, :CHUNK])
        assert reader.metrics.value("kvtier_corrupt_records_total", adapter="local_disk") == 1
        assert reader.lookup(tokens) == CHUNK  # the second record is gone, the first still served
        # the slot the failed decode was reserved in is free again: L1 holds the one promoted chunk only
        assert reader.l1.num_chunks == 1 and reader.l1.used_bytes < 2 * LAYOUT.chunk_bytes(CHUNK)
