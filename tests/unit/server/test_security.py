"""Secret files, derived keys, tenant namespaces, the seeded routing-id counter and /status redaction."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from kvtier.auth.curve import curve_keypair
from kvtier.auth.keyring import KeyRing
from kvtier.auth.secret_file import (
    FULL_ACCESS,
    add_tenant,
    default_secret_file,
    load_or_create,
    read_credentials,
    secret_file_for,
    tenant_credentials,
)
from kvtier.errors import ConfigError
from kvtier.keys import namespace_of, tenant_namespace
from kvtier.server.admin.status import redact

SECRET = "0123456789abcdef" * 4


def write(path, text: str, mode: int = 0o600):
    path.write_text(text)
    path.chmod(mode)
    return path


def test_server_secret_file_is_created_private_and_reused(tmp_path):
    path = tmp_path / "state" / "kvtier" / "server-5555.secret"
    creds, created = load_or_create(path)
    assert created and len(creds.secret) == 64 and creds.tenant is None
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    again, created = load_or_create(path)
    assert not created and again.secret == creds.secret


@pytest.mark.parametrize("text, mode, message", [
    ("secret: " + SECRET, 0o644, "readable by other users (mode 0644); run: chmod 600"),
    ("secret: [", 0o600, "not valid YAML"),
    ("secret: short", 0o600, "at least 32 characters"),
    ("{secret: " + SECRET + ", token: x}", 0o600, "unknown keys ['token']"),
    ("{secret: " + SECRET + ", tenants: {'a/b': " + SECRET + "}}", 0o600, "tenant name 'a/b'"),
    ("{secret: " + SECRET + ", tenant: a}", 0o600, "needs a valid 'tenant' name and the server's 'server_key'"),
    ("- a list", 0o600, "must be a mapping with a 'secret'"),
])
def test_bad_secret_files_are_clear_errors(tmp_path, text, mode, message):
    path = write(tmp_path / "s", text, mode)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        read_credentials(path)


def test_missing_secret_file_names_its_path(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path}/none does not exist"):
        read_credentials(tmp_path / "none")


def test_keys_are_derived_per_secret_and_role():
    server, client = curve_keypair(SECRET, "server"), curve_keypair(SECRET, "client")
    assert server == curve_keypair(SECRET, "server") and server != client
    assert curve_keypair(SECRET[::-1], "client") != client
    assert all(len(k) == 40 for k in (*server, *client))


def test_a_tenant_credential_file_names_the_tenant_and_the_servers_key(tmp_path):
    path = tmp_path / "secrets.yaml"
    server = add_tenant(path, "team-a")
    assert add_tenant(path, "team-a").tenants == server.tenants  # kept, not replaced
    tenant = write(tmp_path / "a.yaml", tenant_credentials(server, "team-a"))
    creds = read_credentials(tenant)
    assert creds.tenant == "team-a" and creds.secret == server.tenants["team-a"]
    assert creds.server_public_key() == server.server_public_key()
    principals = server.principals()
    assert sorted(principals.values()) == [FULL_ACCESS, "team-a"]
    assert principals[__import__("zmq").utils.z85.decode(creds.client_keypair()[0])] == "team-a"
    with pytest.raises(ConfigError, match="tenant name"):
        add_tenant(path, "bad name")


def test_keyring_picks_up_a_new_tenant_without_a_restart(tmp_path):
    path = tmp_path / "secrets.yaml"
    ring = KeyRing(load_or_create(path)[0])
    assert len(ring.principals()) == 1
    time.sleep(0.01)
    add_tenant(path, "late")
    assert sorted(ring.principals().values()) == [FULL_ACCESS, "late"]
    path.chmod(0o644)  # broken meanwhile: the last good keys stay
    os.utime(path)
    assert sorted(ring.principals().values()) == [FULL_ACCESS, "late"]


def test_clients_find_the_secret_file_by_url_port_env_or_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVTIER_AUTH_SECRET_FILE", raising=False)
    assert secret_file_for("tcp://127.0.0.1:5555") == (tmp_path / "kvtier" / "server-5555.secret", False)
    assert default_secret_file(5555) == tmp_path / "kvtier" / "server-5555.secret"
    assert secret_file_for("tcp://h:1", "/x/y") == (__import__("pathlib").Path("/x/y"), True)
    monkeypatch.setenv("KVTIER_AUTH_SECRET_FILE", "/from/env")
    assert secret_file_for("tcp://127.0.0.1:5555")[0].as_posix() == "/from/env"


def test_tenant_namespaces_are_injective_and_never_a_plain_namespace():
    tenants = ["a", "b", "a.b", "ab"]
    plain = ["", namespace_of("lora", "salt"), namespace_of(None, "x"), namespace_of("x", None)]
    named = [*plain, "x", "tenant:b/", "b/"]  # whatever a tenant's client sends
    mixed = {tenant_namespace(t, n) for t in tenants for n in named}
    assert len(mixed) == len(tenants) * len(named)
    assert not mixed & set(plain)


def test_routing_id_counter_is_seeded():
    """libzmq starts a ROUTER's routing-id counter from libc rand(), never seeded by libzmq: the same value in
    every process (1804289383 after glibc's default seed) unless kvtier seeds it."""
    def first_rand(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code + "import ctypes; print(ctypes.CDLL(None).rand())"],
                              capture_output=True, text=True, check=True).stdout.strip()

    assert first_rand("") == "1804289383"
    seeded = {first_rand("from kvtier.auth.zap import seed_routing_ids; seed_routing_ids(); ") for _ in range(2)}
    assert "1804289383" not in seeded and len(seeded) == 2


def test_status_redaction_masks_sas_query_strings_and_secret_keys():
    config = {"l2_adapters": [
        {"type": "azure_blob", "account_url": "https://acct.blob.core.windows.net/?sv=2024-01-01&se=2030&sig=SIGNATURE",
         "connection_string": "DefaultEndpointsProtocol=https;AccountKey=ACCOUNTKEY", "sas_token": "sv=1&sig=OTHER"},
        {"type": "redis", "url": "redis://user:PASSWORD@host:6379/0"},
        {"type": "s3", "endpoint_url": "http://minio:9000/bucket?X-Amz-Signature=AMZSIG"}],
        "l2_record_key": "RECORDKEY"}
    text = yaml.safe_dump(redact(config))
    for secret in ("SIGNATURE", "ACCOUNTKEY", "OTHER", "PASSWORD", "AMZSIG", "RECORDKEY", "se=2030"):
        assert secret not in text
    assert "https://acct.blob.core.windows.net/?***" in text and "redis://***@host:6379/0" in text


def test_status_redaction_shows_settings_whose_names_merely_contain_a_secret_word():
    from kvtier.config import build_config

    config = build_config({"server": {"admin_token": "ADMINTOKEN", "max_prompt_tokens": 4096,
                                      "hash_offload_min_tokens": 512, "auth_secret_file": "/run/kvtier/s.secret"},
                           "l2_record_key": "RECORDKEY",
                           "l2_adapters": [{"type": "s3", "bucket": "b", "aws_access_key_id": "AKID",
                                            "aws_secret_access_key": "SAK", "multipart_threshold_bytes": 8 << 20},
                                           {"type": "redis", "url": "redis://h:6379", "password": "PW",
                                            "max_value_bytes": 2048}]}).model_dump(mode="json")
    config["l2_record_key"] = "RECORDKEY"  # SecretStr dumps as "**********"; redact must not rely on it
    config["server"]["admin_token"] = "ADMINTOKEN"
    out = redact(config)
    assert out["server"]["max_prompt_tokens"] == 4096 and out["server"]["hash_offload_min_tokens"] == 512
    assert out["server"]["auth_secret_file"] == "/run/kvtier/s.secret" and out["server"]["auth"] is True
    assert out["l2_adapters"][0]["multipart_threshold_bytes"] == 8 << 20
    assert out["l2_adapters"][1]["max_value_bytes"] == 2048
    text = repr(out)
    for secret in ("ADMINTOKEN", "RECORDKEY", "AKID", "SAK", "PW"):
        assert secret not in text


def test_a_subscriber_key_is_accepted_on_the_event_sockets_only(tmp_path):
    from kvtier.auth.secret_file import subscriber_credentials
    from zmq.utils import z85

    path = tmp_path / "server.secret"
    load_or_create(path)
    ring = KeyRing(read_credentials(path))
    creds = add_tenant(path, "router-1", role="subscriber")
    out = tmp_path / "router-1.cred"
    out.write_text(subscriber_credentials(creds, "router-1"))
    out.chmod(0o600)
    sub = read_credentials(out)
    assert sub.subscriber == "router-1" and sub.tenant is None and sub.server_public_key() == creds.server_public_key()
    key = z85.decode(sub.client_keypair()[0])
    assert ring.event_principals().get(key) == FULL_ACCESS  # picked up without a restart
    assert key not in ring.principals()
    assert add_tenant(path, "router-1", role="subscriber").subscribers == creds.subscribers  # kept, not renewed


def test_an_authenticated_publisher_refuses_a_topic_that_overlaps_tenant_streams(tmp_path):
    from kvtier.config import KVEventsConfig
    from kvtier.events import EventPublisher

    creds, _ = load_or_create(tmp_path / "server.secret")
    with pytest.raises(ConfigError, match="kv_events.topic 'tenant' cannot be used"):
        EventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0", topic="tenant"), auth=KeyRing(creds))
    # without authentication the same topic is a plain vLLM-compatible PUB
    EventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0", topic="tenant")).close()
