"""``kvtier events subscribe``: print KV cache event batches from kvtier, vLLM or SGLang publishers;
``kvtier events relay``: republish an authenticated stream on ``ipc://`` for plain-ZMQ routers."""

from __future__ import annotations

import json
import sys

import click

from kvtier.events.model import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


def format_event(ev) -> str:
    """One event in the seed's text form, e.g. ``BlockStored(block_hashes=[...], ..., medium='CPU')``."""
    if isinstance(ev, BlockStored):
        text = (f"BlockStored(block_hashes={ev.block_hashes!r}, parent_block_hash={ev.parent_block_hash!r}, "
                f"token_ids={ev.token_ids!r}, block_size={ev.block_size!r}, lora_id={ev.lora_id!r}, "
                f"medium={ev.medium!r}")
        return text + (f", lora_name={ev.lora_name!r})" if ev.lora_name is not None else ")")
    if isinstance(ev, BlockRemoved):
        return f"BlockRemoved(block_hashes={ev.block_hashes!r}, medium={ev.medium!r})"
    if isinstance(ev, AllBlocksCleared):
        return "AllBlocksCleared()"
    return repr(ev)


def format_batch(batch: EventBatch) -> str:
    """``Received event batch at <ts>:`` then one ``- <event>`` line per event."""
    return "\n".join([f"Received event batch at {batch.ts}:"] + [f"- {format_event(e)}" for e in batch.events])


def _jsonable(value):
    return value.hex() if isinstance(value, (bytes, bytearray)) else value


def batch_json(seq: int, batch: EventBatch) -> str:
    """One JSON object: ``{"seq", "ts", "data_parallel_rank", "events": [{"type": ..., field: value}]}``."""
    events = []
    for ev in batch.events:
        obj = {"type": type(ev).__name__}
        for name in ev.__struct_fields__:
            value = getattr(ev, name)
            if isinstance(value, list):
                value = [_jsonable(v) for v in value]
            obj[name] = _jsonable(value)
        events.append(obj)
    return json.dumps({"seq": seq, "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
                       "events": events})


@click.group()
def events() -> None:
    """KV cache events (vLLM-compatible BlockStored / BlockRemoved / AllBlocksCleared)."""


@events.command()
@click.option("--endpoint", default="tcp://127.0.0.1:5557", show_default=True, help="publisher PUB address")
@click.option("--replay-endpoint", default=None, help="publisher replay ROUTER address (recovers missed batches)")
@click.option("--topic", default="", help="only this topic (default: every topic)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per batch")
@click.option("--max-batches", type=click.IntRange(min=1), default=None, help="exit after N batches")
@click.option("--timeout-seconds", "timeout_seconds", type=click.FloatRange(min=0), default=None,
              help="exit after S seconds without a batch")
@click.option("--from-seq", type=click.IntRange(min=0), default=None,
              help="first replay every buffered batch from this seq (needs --replay-endpoint)")
@click.option("--auth-secret-file", default=None, envvar="KVTIER_AUTH_SECRET_FILE",
              help="the kvtier server's secret file, or a tenant's / subscriber's credential file, for a publisher "
                   "with authentication (kv_events.auth)")
def subscribe(endpoint, replay_endpoint, topic, as_json, max_batches, timeout_seconds, from_seq, auth_secret_file) -> None:
    """Print event batches as they arrive; missed batches are replayed, lost ones reported on stderr."""
    from kvtier.events.subscriber import Subscriber

    if from_seq is not None and not replay_endpoint:
        raise click.UsageError("--from-seq needs --replay-endpoint: buffered batches are replayed from there")

    def on_gap(gap):
        click.echo(f"! missed batches {gap.first_missing}..{gap.last_missing}: {gap.reason}", err=True)

    count = 0
    with Subscriber(endpoint, replay_endpoint, topic, start_seq=from_seq, on_gap=on_gap,
                    secret_file=auth_secret_file) as sub:
        try:
            for seq, batch in sub.iter(timeout_seconds):
                click.echo(batch_json(seq, batch) if as_json else format_batch(batch))
                sys.stdout.flush()
                count += 1
                if max_batches is not None and count >= max_batches:
                    break
        except KeyboardInterrupt:
            pass
        s = sub.stats
        skipped = s.wrong_topic + s.bad_seq + s.bad_payload + s.bad_frames
        if skipped:
            click.echo(f"! skipped {skipped} bad frame(s): wrong topic {s.wrong_topic}, bad seq {s.bad_seq}, "
                       f"bad payload {s.bad_payload}, bad frame count {s.bad_frames}", err=True)


@events.command()
@click.option("--endpoint", default="tcp://127.0.0.1:5557", show_default=True, help="the server's kv_events.endpoint")
@click.option("--replay-endpoint", default=None, help="the server's kv_events.replay_endpoint (recovers missed batches)")
@click.option("--auth-secret-file", required=True, envvar="KVTIER_AUTH_SECRET_FILE",
              help="a subscriber's credential file (kvtier auth subscriber), a tenant's, or the server's secret file")
@click.option("--to", "to", required=True, help="ipc:// path to publish on (mode 0600), e.g. ipc:///run/kvtier/events")
@click.option("--replay-to", default=None, help="ipc:// path of a replay socket for the router")
@click.option("--topic", default="kv-events", show_default=True, help="the server's kv_events.topic")
@click.option("--encoding", type=click.Choice(["vllm", "vllm-legacy", "sglang"]), default="vllm", show_default=True)
def relay(endpoint, replay_endpoint, auth_secret_file, to, replay_to, topic, encoding) -> None:
    """Republish an authenticated kvtier event stream on ipc:// for a router on this host that speaks plain ZMQ."""
    from kvtier.events.relay import EventRelay

    with EventRelay(endpoint, replay_endpoint, auth_secret_file, to, replay_to=replay_to, topic=topic,
                    encoding=encoding) as r:
        click.echo(f"relaying {endpoint} to {r.endpoint}" + (f" (replay {r.replay_endpoint})" if replay_to else ""),
                   err=True)
        try:
            r.run()
        except KeyboardInterrupt:
            pass
