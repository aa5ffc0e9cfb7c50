"""The azure_blob adapter against Azurite on 127.0.0.1: startup faults, container and credential errors,
out-of-band deletes, block uploads, and two servers sharing one container."""

from __future__ import annotations

import logging
from contextlib import closing

import pytest
from azure.storage.blob import BlobServiceClient

from kvtier_harness import services
import test_l2_remote_s3 as common  # noqa: E402 - the record helpers and checks all remote adapters share
from test_l2_remote_s3 import payload_of, record  # noqa: E402

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.l2.azure_blob import AzureBlobConfig  # noqa: E402
from kvtier.l2.base import create_adapter  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    with services.azurite(tmp_path_factory.mktemp("azurite")) as az:
        yield az


def spec(az: services.AzuriteService, **kw) -> dict:
    return {"type": "azure_blob", "container": "kvtier-it", "create": True,
            "connection_string": az.connection_string, **kw}


def raw(az: services.AzuriteService):
    return BlobServiceClient.from_connection_string(az.connection_string)


def test_endpoint_down_at_startup_then_recovers(tmp_path):
    port = services.free_port()
    conn = (f"DefaultEndpointsProtocol=http;AccountName={services.AZURITE_ACCOUNT};"
            f"AccountKey={services.AZURITE_KEY};BlobEndpoint=http://127.0.0.1:{port}/{services.AZURITE_ACCOUNT};")
    with closing(create_adapter({"type": "AZURE_BLOB", "container": "kvtier-late", "create": True,
                                 "connection_string": conn, **common.FAST_RETRY})) as adapter:
        reason = common.check_misses_while_down(adapter)
        assert reason != "ok" and services.AZURITE_KEY not in reason
        with services.azurite(tmp_path, port=port):
            common.check_reconnects(adapter, "azure")


def test_missing_container_is_named_or_created(azurite):
    with pytest.raises(ConfigError, match="'kvtier-missing'.*does not exist.*create"):
        create_adapter(spec(azurite, container="kvtier-missing", create=False))
    with closing(create_adapter(spec(azurite, container="kvtier-created"))):
        assert raw(azurite).get_container_client("kvtier-created").exists()


def test_wrong_key_is_a_clear_error_without_the_secret(azurite, caplog):
    caplog.set_level(logging.DEBUG)
    wrong_key = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXk="  # valid base64, not the account's key
    conn = azurite.connection_string.replace(services.AZURITE_KEY, wrong_key)
    with pytest.raises(ConfigError) as info:
        create_adapter(spec(azurite, connection_string=conn))
    message = str(info.value)
    assert "'kvtier-it'" in message and "authentication" in message
    for secret in (wrong_key, conn):
        assert secret not in message and secret not in caplog.text
    # the same through account_url + account_name + credential
    with pytest.raises(ConfigError, match="authentication"):
        create_adapter({"type": "azure_blob", "container": "kvtier-it", "account_url": azurite.account_url,
                        "account_name": services.AZURITE_ACCOUNT, "credential": wrong_key})
    assert wrong_key not in caplog.text
    config = AzureBlobConfig(type="azure_blob", container="kvtier-it", connection_string=conn)
    assert wrong_key not in repr(config) and wrong_key not in str(config.model_dump())


def test_account_url_with_key_works(azurite):
    with closing(create_adapter({"type": "azure_blob", "container": "kvtier-key", "create": True,
                                 "account_url": azurite.account_url, "account_name": services.AZURITE_ACCOUNT,
                                 "credential": services.AZURITE_KEY})) as adapter:
        common.round_trip(adapter, 5)


def test_record_deleted_out_of_band_is_a_miss(azurite):
    with closing(create_adapter(spec(azurite, prefix="oob/"))) as adapter:
        name, parts, _ = record(2)
        assert adapter.put([(name, parts)]) == [True]
        raw(azurite).get_container_client("kvtier-it").delete_blob("oob/" + name)
        assert adapter.contains([name]) == [False]
        assert adapter.get([name]) == [None]


def test_large_record_goes_in_blocks_and_round_trips(azurite):
    with closing(create_adapter(spec(azurite, prefix="blocks/", max_single_put_bytes=4 << 20))) as adapter:
        name, parts, payload = record(3, KVLayout(num_layers=30, num_kv_heads=3, head_dim=64), 256)
        assert adapter.put([(name, parts)]) == [True]
        blob = raw(azurite).get_container_client("kvtier-it").get_blob_client("blocks/" + name)
        committed, _ = blob.get_block_list("committed")
        assert len(committed) >= 2  # uploaded as blocks, made visible by one Put Block List
        assert payload_of(adapter.get([name])[0]) == payload


def test_two_servers_share_one_container(azurite):
    with (closing(create_adapter(spec(azurite, prefix="shared/"))) as first,
          closing(create_adapter(spec(azurite, prefix="shared/"))) as second):
        common.check_shared(first, second, [record(10 + i) for i in range(3)])
