"""``kvtier server`` and ``kvtier status``.

Startup problems (L1 size 0, a port in use, a bad ``--l2-adapter`` JSON, an unknown adapter type or a
missing field) raise ConfigError, which ``kvtier.cli.main`` prints as one ``error: ...`` line, exit 2.
SIGINT/SIGTERM: stop answering, finish queued L2 writes (bounded by ``server.shutdown_timeout_seconds``),
close sockets, unlink the shared L1, exit 0.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import urllib.error
import urllib.request

import click

from kvtier.config import EVICTION_POLICIES, load_config
from kvtier.errors import ConfigError, KVTierError
from kvtier.hashing import ALGORITHMS


def _adapter_spec(value: str) -> dict:
    try:
        spec = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--l2-adapter {value!r} is not valid JSON ({exc.msg} at column {exc.colno}); "
                          """write e.g. '{"type": "local_disk", "path": "/data/kvtier"}'""") from exc
    if not isinstance(spec, dict):
        raise ConfigError(f"--l2-adapter must be a JSON object with a 'type', got {value!r}")
    return spec


@click.command()
@click.option("--host", default=None, help="Request socket address [default: 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Request socket port (ZMQ ROUTER) [default: 5555; 0: any].")
@click.option("--admin-host", default=None, help="Admin HTTP address [default: 127.0.0.1].")
@click.option("--admin-port", type=int, default=None, help="Admin HTTP port [default: 8080; 0: any].")
@click.option("--l1-size-gb", default=None, help="L1 (shared host memory) size, e.g. 8 or '512MiB'. Required.")
@click.option("--eviction-policy", default=None,
              help=f"L1 eviction policy: {', '.join(EVICTION_POLICIES)} (any case; S3-FIFO accepted). Required.")
@click.option("--chunk-size", type=int, default=None, help="Tokens per chunk [default: 256].")
@click.option("--block-size", type=int, default=None,
              help="The engines' block size: hashes chain per block of this many tokens, and events name these "
                   "blocks; must divide the chunk size [default: the chunk size].")
@click.option("--hash-algorithm", type=click.Choice(ALGORITHMS), default=None,
              help="Prefix-hash algorithm (vLLM's --prefix-caching-hash-algo names) [default: sha256].")
@click.option("--hash-seed", default=None,
              help="Root-hash seed: vLLM's PYTHONHASHSEED when it has one [default: vllm-none-hash].")
@click.option("--l2-adapter", "l2_adapters", multiple=True,
              help="""L2 adapter JSON, repeatable, in cascade order, e.g. '{"type": "local_disk", "path": "/data/kvtier"}'.""")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="YAML configuration file (or KVTIER_CONFIG_FILE).")
@click.option("--admin-token", envvar="KVTIER_ADMIN_TOKEN", default=None,
              help="Token every mutation needs: POST /clear, the ZMQ Clear (or KVTIER_ADMIN_TOKEN).")
@click.option("--allow-unauthenticated-admin", is_flag=True, default=None,
              help="With no admin token, accept mutations (POST /clear, Clear) from any client [default: refused].")
@click.option("--auth/--no-auth", "auth", default=None,
              help="Clients must hold the secret (CurveZMQ) [default: on]; --no-auth only on a trusted network.")
@click.option("--auth-secret-file", default=None, type=click.Path(dir_okay=False),
              help="Secret file (created if missing) [default: $XDG_RUNTIME_DIR/kvtier/server-<port>.secret].")
@click.option("--lease-seconds", type=float, default=None, help="Pins held for a client expire after this [default: 30].")
@click.option("--promote-timeout-seconds", type=float, default=None,
              help="Deadline of an L2 -> L1 promotion; then the request is a miss [default: 5].")
@click.option("--shared-memory/--no-shared-memory", default=None,
              help="Same-host clients copy KV through the shared L1 [default: on].")
@click.option("--enable-kv-events/--disable-kv-events", "enable_kv_events", default=None,
              help="Publish KV cache events (BlockStored / BlockRemoved / AllBlocksCleared) [default: off].")
@click.option("--kv-events-endpoint", default=None, help="Event PUB address [default: tcp://127.0.0.1:5557].")
@click.option("--kv-events-replay-endpoint", default=None, help="Event replay ROUTER address [default: none].")
@click.option("--kv-events-topic", default=None, help="Event topic [default: kv-events].")
@click.option("--kv-events-encoding", type=click.Choice(["vllm", "vllm-legacy", "sglang"]), default=None,
              help="Event wire encoding [default: vllm].")
@click.option("--trace-file", type=click.Path(dir_okay=False), default=None,
              help="Record every lookup / retrieve / prefetch / store to this file (JSON lines, replayed by "
                   "kvtier simulate) [default: off].")
@click.option("--trace-max-bytes", default=None,
              help="The trace file stops growing at this size, e.g. '1GB'; later requests are counted, not "
                   "recorded [default: 1GiB].")
@click.option("--trace-token-ids/--no-trace-token-ids", default=None,
              help="Trace records carry the prompts' token ids [default: off: chunk digests only].")
@click.option("--event-block-size", type=int, default=None, hidden=True)  # removed: says to use --block-size
@click.option("--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
              help="Server log verbosity [default: INFO].")
def server(host, port, admin_host, admin_port, l1_size_gb, eviction_policy, chunk_size, block_size, hash_algorithm,
           hash_seed, l2_adapters, config_path, admin_token, allow_unauthenticated_admin, auth, auth_secret_file,
           lease_seconds, promote_timeout_seconds, shared_memory, enable_kv_events,
           kv_events_endpoint, kv_events_replay_endpoint, kv_events_topic, kv_events_encoding, trace_file,
           trace_max_bytes, trace_token_ids, event_block_size, log_level) -> None:
    """Run the kvtier cache server: ZMQ requests on --port, admin HTTP on --admin-port."""
    if event_block_size is not None:
        raise ConfigError("--event-block-size was removed: use --block-size (the engine's block size); hashes "
                          "chain per block and events name those blocks")
    srv = {"host": host, "port": port, "admin_host": admin_host, "admin_port": admin_port,
           "admin_token": admin_token, "lease_seconds": lease_seconds, "shared_memory": shared_memory,
           "promote_timeout_seconds": promote_timeout_seconds,
           "allow_unauthenticated_admin": allow_unauthenticated_admin, "auth": auth, "auth_secret_file": auth_secret_file,
           "trace_file": trace_file, "trace_max_bytes": trace_max_bytes, "trace_token_ids": trace_token_ids}
    events = {"endpoint": kv_events_endpoint, "replay_endpoint": kv_events_replay_endpoint,
              "topic": kv_events_topic, "encoding": kv_events_encoding}
    overrides = {"l1_size_gb": l1_size_gb, "eviction_policy": eviction_policy, "chunk_size": chunk_size,
                 "block_size": block_size, "hash_algorithm": hash_algorithm, "hash_seed": hash_seed, "server": srv,
                 "enable_kv_events": enable_kv_events, "kv_events": events}
    if l2_adapters:
        overrides["l2_adapters"] = [_adapter_spec(v) for v in l2_adapters]
    config = load_config(config_path, overrides)
    for key, flag in (("l1_size_gb", "--l1-size-gb"), ("eviction_policy", "--eviction-policy")):
        if key not in config.model_fields_set:
            raise ConfigError(f"{flag} is required (or set {key} in the --config file, or KVTIER_{key.upper()})")
    if config.l1_size_gb <= 0:
        raise ConfigError(f"--l1-size-gb must be > 0 (got {config.l1_size_gb:g}): L1 is where every chunk lands first")
    run(config, log_level)


def run(config, log_level: str = "INFO") -> None:
    """Start the server and admin HTTP, serve until SIGINT/SIGTERM, then shut down cleanly."""
    from kvtier.auth.keyring import log_auth
    from kvtier.server.admin.http import AdminHTTP
    from kvtier.server.server import KVTierServer
    from kvtier.server.admin.telemetry import Telemetry

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kvtier.server")
    kv_server = KVTierServer(config)
    telemetry = Telemetry(kv_server.metrics, before_collect=kv_server.tiers.refresh_gauges)
    srv = config.server
    try:
        admin = AdminHTTP(kv_server, telemetry, srv.admin_host, srv.admin_port)
    except BaseException:
        kv_server.close()
        telemetry.close()
        raise
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: kv_server.stop())
    admin.start()
    log.info("kvtier server ready: requests %s, admin %s, L1 %d bytes (%s), shm %s, %d L2 adapter(s)",
             kv_server.endpoint, admin.url, kv_server.tiers.l1.capacity_bytes, config.eviction_policy,
             kv_server.shm_name or "off", len(kv_server.tiers.l2.adapters))
    log_auth(kv_server.keyring, config.server.host, kv_server.port)
    emitter = kv_server.tiers.events
    if emitter is not None and emitter.publisher is not None:
        log.info("KV cache events: publishing on %s (replay %s, topic %r, encoding %s)",
                 emitter.publisher.endpoint, emitter.publisher.replay_endpoint or "off",
                 config.kv_events.topic, config.kv_events.encoding)
    try:
        kv_server.serve_forever()
    finally:
        log.info("shutting down: finishing queued L2 writes (at most %.0f s)", srv.shutdown_timeout_seconds)
        admin.stop()
        flushed = kv_server.close()
        telemetry.close()
        log.info("stopped%s", "" if flushed else " (some L2 writes were still queued at the deadline)")


@click.command()
@click.option("--admin-url", default="http://127.0.0.1:8080", show_default=True, help="The server's admin HTTP.")
@click.option("--timeout-seconds", "timeout_seconds", type=click.FloatRange(min=0, min_open=True), default=5.0,
              show_default=True, help="Seconds to wait (> 0).")
def status(admin_url: str, timeout_seconds: float) -> None:
    """Print a running server's /status (JSON)."""
    url = admin_url.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout_seconds) as response:
            body = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise KVTierError(f"cannot read {url}: {getattr(exc, 'reason', exc)}; is the server running?") from exc
    json.dump(body, sys.stdout, indent=2)
    sys.stdout.write("\n")
