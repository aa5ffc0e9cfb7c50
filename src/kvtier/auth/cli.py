"""``kvtier auth tenant | subscriber``: add a key to a server's secret file and write its credential file.

The secret file is ``kvtier.auth.secret_file``'s; a running server picks a new key up without a restart. A bad
name, an unwritable output or secret file is a ConfigError, printed as one ``error: ...`` line (exit 2), and the
secret file is left as it was.
"""

from __future__ import annotations

from pathlib import Path

import click

from kvtier.auth.secret_file import (add_tenant, check_writable, default_secret_file, subscriber_credentials,
                                     tenant_credentials, write_private)


@click.group()
def auth() -> None:
    """Secret files of a kvtier server (see docs/deployment.md, "Security")."""


def _key_options(what: str):
    def wrap(fn):
        fn = click.option("--out", type=click.Path(dir_okay=False), required=True,
                          help=f"Where to write the {what}'s credential file.")(fn)
        fn = click.option("--secret-file", type=click.Path(dir_okay=False), default=None,
                          help="The server's secret file [default: the one for --port].")(fn)
        fn = click.option("--port", type=click.IntRange(1, 65535), default=5555, show_default=True,
                          help="The server's port (names its default secret file).")(fn)
        return click.argument("name")(fn)
    return wrap


def _add(name: str, port: int, secret_file: str | None, out: str, role: str) -> Path:
    """Add ``name`` as ``role`` to the secret file and write its credential file; returns the secret file."""
    path = Path(secret_file) if secret_file else default_secret_file(port)
    check_writable(Path(out))  # before the key is added: a failed run leaves the secret file as it was
    creds = add_tenant(path, name, role=role)
    text = tenant_credentials(creds, name) if role == "tenant" else subscriber_credentials(creds, name)
    write_private(Path(out), text)
    return path


@auth.command("tenant")
@_key_options("tenant")
def tenant(name: str, port: int, secret_file: str | None, out: str) -> None:
    """Add tenant NAME to the server's secret file (a running server picks it up) and write its credential file.

    Engines given that file (client secret_file=..., $KVTIER_AUTH_SECRET_FILE, or the vLLM connector key
    kvtier.auth_secret_file) reach only NAME's chunks, and get no shared memory.
    """
    path = _add(name, port, secret_file, out, "tenant")
    click.echo(f"tenant {name!r} is in {path}; its credential file is {out} (mode 0600): hand it to its engines")


@auth.command("subscriber")
@_key_options("subscriber")
def subscriber(name: str, port: int, secret_file: str | None, out: str) -> None:
    """Add KV event subscriber NAME to the server's secret file and write its credential file.

    Its key reads every tenant's KV events (live and replay; kvtier events subscribe / relay
    --auth-secret-file) and is refused on the request port: give it to routers, not engines.
    """
    path = _add(name, port, secret_file, out, "subscriber")
    click.echo(f"subscriber {name!r} is in {path}; its credential file is {out} (mode 0600): hand it to the router "
               "(kvtier events subscribe / relay --auth-secret-file)")
