"""Configuration: sources and priority, LMCache keys, size and bool parsing, clear errors."""

import logging

import pytest

from kvtier.config import build_config, load_config
from kvtier.errors import ConfigError
from kvtier.units import parse_bool, parse_size


@pytest.mark.parametrize("text,gb", [("5GB", 5), ("512MiB", 512 * 2**20 / 1e9), ("1.5", 1.5), (2, 2),
                                      ("100B", 1e-7), ("1TiB", 2**40 / 1e9), (" 3 gb ", 3)])
def test_parse_size(text, gb):
    assert parse_size(text) == pytest.approx(gb)


@pytest.mark.parametrize("bad", ["-1GB", "1.5XB", "lots", -3, True])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


@pytest.mark.parametrize("text,value", [("false", False), ("0", False), ("no", False), ("OFF", False),
                                         ("true", True), ("1", True), ("yes", True), ("on", True)])
def test_parse_bool(text, value):
    assert parse_bool(text) is value


def test_env_false_means_false_and_priority(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 128\nenable_kv_events: true\nl1_size_gb: 2\n")
    cfg = load_config(f, environ={"KVTIER_ENABLE_KV_EVENTS": "false", "KVTIER_L1_SIZE_GB": "3GB"})
    assert cfg.enable_kv_events is False and cfg.l1_size_gb == 3 and cfg.chunk_size == 128
    cfg = load_config(f, overrides={"l1_size_gb": 4, "chunk_size": None},
                      environ={"KVTIER_L1_SIZE_GB": "3GB"})
    assert cfg.l1_size_gb == 4 and cfg.chunk_size == 128
    cfg = load_config(environ={"KVTIER_CONFIG_FILE": str(f), "KVTIER_KV_EVENTS__TOPIC": "t",
                               "KVTIER_MODEL_CACHE": "/tmp/models"})
    assert cfg.chunk_size == 128 and cfg.kv_events.topic == "t"


def test_lmcache_style_file(tmp_path):
    f = tmp_path / "lmcache.yaml"
    f.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 5\nlocal_disk: file:///tmp/kvdisk\n"
                 "max_local_disk_size: 20\nenable_kv_events: true\npre_caching_hash_algorithm: sha256_cbor\n"
                 "save_unfull_chunk: false\n")
    cfg = load_config(f, environ={})
    assert cfg.l1_size_gb == 5 and cfg.enable_kv_events and cfg.hash_algorithm == "sha256_cbor"
    assert cfg.l2_adapters == [{"type": "local_disk", "path": "/tmp/kvdisk", "size_gb": 20.0}]


@pytest.mark.parametrize("data,needle", [
    ({"chunk_sze": 3}, "did you mean 'chunk_size'"),
    ({"kv_events": {"endpont": "x"}}, "did you mean 'endpoint'"),
    ({"l1_size_gb": "-1GB"}, "l1_size_gb"),
    ({"l1_size_gb": "1.5XB"}, "unknown size unit"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": "many"}, "chunk_size"),
    ({"eviction_policy": "MRU"}, "LRU, ARC, S3FIFO"),
    ({"hash_algorithm": "md5"}, "sha256_cbor"),
    ({"save_unfull_chunk": "maybe"}, "boolean"),
    ({"kv_events": {"event_block_size": 16}}, "'kv_events.event_block_size' was removed: events are published per "
                                              "engine block of the top-level 'block_size' (flag --block-size"),
    ({"chunk_size": 256, "block_size": 96}, "block_size .96. must divide chunk_size .256."),
    ({"block_size": 0}, "block_size"),
])
def test_errors_name_the_key(data, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        build_config(data)


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f, environ={})


def test_admin_token_is_secret():
    cfg = load_config(environ={"KVTIER_ADMIN_TOKEN": "hunter2"})
    assert cfg.server.admin_token.get_secret_value() == "hunter2"
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg.model_dump())


def test_unknown_environment_variable_is_a_warning_naming_it(caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.config.load"):
        cfg = load_config(environ={"KVTIER_L1_SIZE": "2", "KVTIER_REPO": "/src/x", "KVTIER_CHUNK_SIZE": "128",
                                   "KVTIER_KV_EVENTS__TOPC": "t"})
    assert cfg.chunk_size == 128  # the known variable still applies
    text = caplog.text
    assert "KVTIER_L1_SIZE" in text and "did you mean 'l1_size_gb'" in text
    assert "KVTIER_REPO" in text
    assert "KVTIER_KV_EVENTS__TOPC" in text and "'kv_events.topc'" in text and "did you mean 'topic'" in text


def test_unknown_key_in_a_file_or_a_flag_stays_an_error(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("l1_size: 2\n")
    with pytest.raises(ConfigError, match="did you mean 'l1_size_gb'"):
        load_config(f, environ={})
    with pytest.raises(ConfigError, match="unknown key 'repo'"):
        load_config(overrides={"repo": "x"}, environ={})
    with pytest.raises(ConfigError, match="bad|invalid|key 'chunk_size'"):
        load_config(environ={"KVTIER_CHUNK_SIZE": "-1"})  # a known variable with a bad value: still an error


def test_block_size_defaults_to_the_chunk_size_and_hashing_to_vllms_defaults():
    cfg = build_config({"chunk_size": 256})
    assert cfg.block_size is None and cfg.effective_block_size == 256
    assert (cfg.hash_algorithm, cfg.hash_seed) == ("sha256", "vllm-none-hash")
    assert build_config({"chunk_size": 256, "block_size": 16}).effective_block_size == 16
    assert load_config(environ={"KVTIER_BLOCK_SIZE": "128", "KVTIER_CHUNK_SIZE": "256"}).block_size == 128
    with pytest.raises(ConfigError, match="--block-size"):
        load_config(environ={"KVTIER_KV_EVENTS__EVENT_BLOCK_SIZE": "16"})


def test_renamed_key_is_refused_naming_the_new_key(tmp_path):
    """A former unit-less key name stops startup naming its new name (a silent ignore would drop the setting)."""
    f = tmp_path / "old.yaml"
    f.write_text("kv_events:\n  batch_max_delay_ms: 5\n")
    for kwargs in ({"path": f, "environ": {}}, {"environ": {"KVTIER_KV_EVENTS__BATCH_MAX_DELAY_MS": "5"}}):
        with pytest.raises(ConfigError, match="in section 'kv_events': key 'batch_max_delay_ms' was renamed to "
                                              "'batch_max_delay_seconds' .the value is now in seconds"):
            load_config(**kwargs)
    assert build_config({"kv_events": {"batch_max_delay_seconds": 0.005}}).kv_events.batch_max_delay_seconds == 0.005


@pytest.mark.parametrize("spec,needle", [
    ({"type": "memory", "size_gb": 1, "latency_ms": 5}, "unknown field 'latency_ms'"),  # only faulty had it
    ({"type": "faulty", "inner": {"type": "memory"}, "latency_ms": 5},
     "key 'latency_ms' was renamed to 'latency_seconds' .the value is now in seconds"),
    # checked before any connection is tried; fields of the shared base (connect_timeout_s) too
    ({"type": "redis", "url": "redis://127.0.0.1:1", "ttl_s": 60, "connect_timeout_s": 1},
     "key 'connect_timeout_s' was renamed to 'connect_timeout_seconds'; key 'ttl_s' was renamed to 'ttl_seconds'"),
    ({"type": "s3", "bucket": "kvtier", "multipart_threshold_mb": 8},
     "key 'multipart_threshold_mb' was renamed to 'multipart_threshold_bytes' .the value is now in bytes"),
])
def test_renamed_adapter_field_is_refused_naming_the_new_field(spec, needle):
    from kvtier.l2 import create_adapter

    with pytest.raises(ConfigError, match=needle):
        create_adapter(spec)
    assert create_adapter({"type": "faulty", "inner": {"type": "memory"}, "latency_seconds": 0.001}).config.latency_seconds == 0.001


@pytest.mark.parametrize("text", ['[{"type": ', "{a: [1, 2}"])
def test_malformed_env_json_names_the_variable(text):
    with pytest.raises(ConfigError, match="environment variable KVTIER_L2_ADAPTERS is not valid JSON/YAML"):
        load_config(environ={"KVTIER_L2_ADAPTERS": text})


def test_section_that_is_not_a_mapping_is_refused_even_without_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("l1_size_gb: 1\nserver: 5\n")
    # the CLI passes one dict per section whose flags were all left out: they must not replace the file's value
    with pytest.raises(ConfigError, match="key 'server'"):
        load_config(f, overrides={"server": {"port": None, "host": None}, "kv_events": {"topic": None}}, environ={})
    with pytest.raises(ConfigError, match="key .server."):  # flags of that section do not hide it either
        load_config(f, overrides={"server": {"port": 0}}, environ={"KVTIER_SERVER__HOST": "127.0.0.1"})


def test_l2_promote_is_refused_as_removed():
    with pytest.raises(ConfigError, match="'l2_promote' was removed: L2 hits are always copied into L1"):
        build_config({"l2_promote": False})
    with pytest.raises(ConfigError, match="'l2_promote' was removed"):
        load_config(environ={"KVTIER_L2_PROMOTE": "true"})
    assert build_config({"l2_promote_to_faster_l2": True}).l2_promote_to_faster_l2 is True


def test_lmcache_remote_keys_are_refused_with_the_redis_adapter_to_use(tmp_path):
    f = tmp_path / "lmcache.yaml"
    f.write_text("chunk_size: 256\nremote_url: redis://user:pw@cache.example:6380/2\nremote_serde: naive\n")
    with pytest.raises(ConfigError, match="remote_url") as info:
        load_config(f, environ={})
    assert "l2_adapters: [{type: redis, url: 'redis://cache.example:6380/2'}]" in str(info.value)
    assert "pw" not in str(info.value)
    f.write_text("remote_url: lm://localhost:65432\n")
    with pytest.raises(ConfigError, match="no L2 adapter for that scheme"):
        load_config(f, environ={})
    f.write_text("remote_serde: naive\n")
    with pytest.raises(ConfigError, match="'remote_serde' is not read by kvtier"):
        load_config(f, environ={})


def test_redis_max_value_bytes_takes_a_size_string():
    from kvtier.l2.redis import RedisConfig

    assert RedisConfig(type="redis", url="redis://127.0.0.1:1", max_value_bytes="64MiB").max_value_bytes == 64 << 20
    assert RedisConfig(type="redis", url="redis://127.0.0.1:1", max_value_bytes=4096).max_value_bytes == 4096
    with pytest.raises(ValueError, match="greater than or equal to 1024"):
        RedisConfig(type="redis", url="redis://127.0.0.1:1", max_value_bytes="1KB")


def test_adapter_field_message_is_the_validators_own():
    from kvtier.l2 import create_adapter

    with pytest.raises(ConfigError) as info:
        create_adapter({"type": "redis", "url": "http://127.0.0.1:1"})
    assert "field 'url': url scheme must be redis://" in str(info.value)
    assert "Value error" not in str(info.value)
