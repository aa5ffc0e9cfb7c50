"""``kvtier`` command line: server | status | cache | auth | events | demo | simulate.

Subcommands live next to what they drive and are imported only when used, so ``kvtier --help``
stays fast and a light install does not need torch or the server extras.
"""

from __future__ import annotations

import importlib

import click

from kvtier import __version__
from kvtier.errors import KVTierError

# name -> "module:attribute" of a click command
_COMMANDS = {
    "server": ("kvtier.server.cli:server", "run the kvtier cache server (ZMQ + admin HTTP)"),
    "status": ("kvtier.server.cli:status", "show a running server's /status"),
    "cache": ("kvtier.server.admin.cache_cli:cache", "management API: look up, pin, TTL, delete a prompt's or session's chunks"),
    "auth": ("kvtier.auth.cli:auth", "secret files: add a tenant or an event subscriber and write its credential file"),
    "events": ("kvtier.events.cli:events", "subscribe to KV cache events"),
    "demo": ("kvtier.demo.cli:demo", "multi-round QA on a real model, showing TTFT with kvtier"),
    "simulate": ("kvtier.trace.cli:simulate_cmd", "replay a server's trace at other L1 / L2 sizes and policies"),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(_COMMANDS)

    def get_command(self, ctx, name):
        if name not in _COMMANDS:
            return None
        module, attr = _COMMANDS[name][0].split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            raise click.ClickException(f"'kvtier {name}' needs a package that is not installed ({exc.name}); "
                                       "install the extras: pip install 'kvtier[all]'") from None

    def format_commands(self, ctx, formatter):
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_) for name, (_, help_) in sorted(_COMMANDS.items())], col_max=12)


@click.group(cls=_LazyGroup)
@click.version_option(__version__, prog_name="kvtier")
def cli() -> None:
    """kvtier: a tiered KV cache for LLM inference (prefill once, reuse everywhere)."""


def main() -> None:
    """Console entry point: a KVTierError or an OSError prints as one clear line and exits 2."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        raise SystemExit(130) from None
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None
    except KVTierError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None
    except OSError as exc:  # a file or socket kvtier did not anticipate: one line naming it, not a traceback
        click.echo(f"error: {_describe_os_error(exc)}", err=True)
        raise SystemExit(2) from None
    except SystemExit:
        raise


def _describe_os_error(exc: OSError) -> str:
    """``<what failed>: <path>[ -> <path2>]`` from an OSError (the paths it carries), else its text."""
    what = exc.strerror or str(exc) or type(exc).__name__
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    return f"{what}: {' -> '.join(paths)}" if paths else what
