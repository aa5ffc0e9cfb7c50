"""The vLLM connector's settings (``connectors/vllm_config.py``): one config tree, engine hashing, per-request
controls. No vLLM needed: these are the parsers the connector calls."""

from __future__ import annotations

import pytest

from kvtier.connectors.vllm_config import (
    NO_TRANSFER,
    RequestControls,
    connector_config,
    request_controls,
    valid_keys,
)
from kvtier.errors import ConfigError
from kvtier.hints import RetentionHint

ENGINE = {"block_size": 128, "hash_algorithm": "sha256", "hash_seed": "0"}


def config(extra, environ=None):
    return connector_config(extra, ENGINE, environ=environ or {})


def test_extra_config_keys_land_in_the_one_tree():
    cfg = config({"kvtier.server_url": "tcp://127.0.0.1:5555", "kvtier.load_timeout_seconds": "2.5",
                  "kvtier.use_layerwise": "yes", "kvtier.chunk_size": 256, "kvtier.l1_size_gb": "512MB"})
    assert cfg.connector.server_url == "tcp://127.0.0.1:5555"
    assert cfg.connector.load_timeout_seconds == 2.5 and cfg.connector.use_layerwise is True
    assert cfg.chunk_size == 256 and cfg.l1_size_gb == 0.512
    assert (cfg.block_size, cfg.hash_algorithm, cfg.hash_seed) == (128, "sha256", "0")  # the engine's, always
    assert "chunk_size" in cfg.model_fields_set
    assert "chunk_size" not in config({}).model_fields_set  # unset: the server's chunk size wins


def test_environment_and_file_feed_the_connector_too(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("connector:\n  load_timeout_seconds: 7\nchunk_size: 512\n")
    cfg = config({"kvtier.chunk_size": 256},
                 environ={"KVTIER_CONFIG_FILE": str(path), "KVTIER_CONNECTOR__TIMEOUT_SECONDS": "3"})
    assert cfg.connector.load_timeout_seconds == 7 and cfg.connector.timeout_seconds == 3
    assert cfg.chunk_size == 256  # kv_connector_extra_config wins over the file


def test_local_disk_is_an_l2_adapter(tmp_path):
    cfg = config({"kvtier.local_disk": str(tmp_path)})
    assert cfg.l2_adapters == [{"type": "local_disk", "path": str(tmp_path)}]
    assert cfg.connector.server_url is None


@pytest.mark.parametrize("value", [0, -1, "0"])
def test_load_timeout_must_be_positive(value):
    with pytest.raises(ConfigError, match=r"kvtier\.load_timeout_seconds.*greater than 0"):
        config({"kvtier.load_timeout_seconds": value})


@pytest.mark.parametrize("key", ["kvtier.block_size", "kvtier.hash_algorithm", "kvtier.hash_seed"])
def test_engine_hashing_is_never_a_connector_key(key):
    with pytest.raises(ConfigError, match=f"{key} comes from vLLM's engine config"):
        config({key: "x"})


def test_unknown_and_renamed_keys():
    with pytest.raises(ConfigError, match=r"unknown kvtier connector key 'kvtier.chunksize'.*did you mean "
                                          r"'kvtier.chunk_size'"):
        config({"kvtier.chunksize": 256})
    with pytest.raises(ConfigError, match="unknown kvtier connector key 'server_url'"):
        config({"server_url": "tcp://127.0.0.1:1"})
    with pytest.raises(ConfigError, match="unknown kvtier connector key 'kvtier.server.port'"):
        config({"kvtier.server.port": 1})
    with pytest.raises(ConfigError, match="'kvtier.timeout_s' was renamed to 'kvtier.timeout_seconds'"):
        config({"kvtier.timeout_s": 2})
    assert "kvtier.load_timeout_seconds" in valid_keys() and "kvtier.block_size" not in valid_keys()


def test_request_controls():
    assert request_controls(None) == RequestControls()
    assert request_controls({"do_remote_prefill": True}) == RequestControls()  # another connector's key
    assert request_controls({"max_load_tokens": 0}) == RequestControls(0, None)
    assert request_controls({"max_offload_tokens": 512, "max_load_tokens": 256}) == RequestControls(256, 512)
    assert request_controls({"kvtier.skip_store": True}) == RequestControls(None, 0)
    assert request_controls({"kvtier.skip_load": "yes", "kvtier.skip_store": False}) == RequestControls(0, None)
    assert NO_TRANSFER == RequestControls(0, 0)
    hinted = request_controls({"kvtier.session_id": "agent-1", "kvtier.priority": 2, "kvtier.ttl_seconds": 90})
    assert hinted == RequestControls(hint=RetentionHint(2, 90.0, "agent-1"))


@pytest.mark.parametrize("params, message", [
    ({"kvtier.skip_stor": True}, r"unknown kvtier key 'kvtier.skip_stor' in kv_transfer_params; did you mean "
                                 r"'kvtier.skip_store'"),
    ({"max_load_tokens": -1}, r"kv_transfer_params\['max_load_tokens'\] = -1: must be an int >= 0"),
    ({"max_offload_tokens": "10"}, r"must be an int >= 0"),
    ({"kvtier.skip_load": "maybe"}, r"kv_transfer_params\['kvtier.skip_load'\]: cannot read 'maybe'"),
    ({"kvtier.ttl_seconds": 0}, r"'ttl_seconds' must be > 0"),
    ({"kvtier.priority": 5}, r"'priority' must be an int from 0 to 3"),
    ({"kvtier.sesion_id": "a"}, r"did you mean 'kvtier.session_id'"),
])
def test_bad_request_controls(params, message):
    with pytest.raises(ConfigError, match=message):
        request_controls(params)


def test_chunk_size_must_be_a_multiple_of_the_engine_block_size():
    with pytest.raises(ConfigError, match="kvtier chunk_size 200 is not a multiple of vLLM's block size 128; use one "
                                          "of 128, 256, 384, 512"):
        config({"kvtier.chunk_size": 200})
