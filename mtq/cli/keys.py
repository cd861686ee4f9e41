"""``mtq keys create|list|revoke``: API keys (:mod:`mtq.client.apikeys`)."""

from __future__ import annotations

from datetime import datetime

import click

from mtq.cli.common import (
    NOT_FOUND,
    connect_client,
    console,
    echo_json,
    fail,
    fail_on,
    json_option,
    printable,
    redis_option,
    shown,
)
from mtq.errors import MtqError


@click.group()
def keys() -> None:
    """API keys of the OpenAI-compatible gateway ('mtq serve') and, with --admin, of the
    web dashboard's actions: Redis keeps a digest of each, never the key itself."""


def _stamp(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


@keys.command("create")
@click.option("--tenant", required=True, help="The tenant its requests are queued under.")
@click.option("--priority", type=click.Choice(["interactive", "standard", "batch"]),
              default=None, help="The band its requests get (default: the gateway's).")
@click.option("--rpm", type=click.IntRange(1, 10**12), default=None,
              help="Requests per minute it may make (default: no limit).")
@click.option("--tpm", type=click.IntRange(1, 10**12), default=None,
              help="Tokens per minute it may use (default: no limit).")
@click.option("--name", default="", help="A note for people (who holds it, what for).")
@click.option("--admin", is_flag=True,
              help="It may also act on the web dashboard (pause, resume, drain, scale, "
                   "cancel, dead letters); on the gateway it acts as its tenant.")
@redis_option
@json_option
def keys_create(tenant: str, priority: str | None, rpm: int | None, tpm: int | None,
                name: str, admin: bool, url: str | None, as_json: bool) -> None:
    """Make an API key for a tenant and print it, once: only its digest is kept."""
    from mtq.client import apikeys as api

    client = connect_client(url, start=True)
    try:
        token, key = api.create(client, tenant, priority=priority, rpm=rpm, tpm=tpm,
                                name=name, admin=admin)
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json({"token": token, **key.as_dict()})
        return
    click.echo(token)
    kind = "admin key" if key.admin else "key"
    click.echo(f"{kind} {key.id} for tenant {key.tenant}: keep it now, it cannot be shown "
               f"again (mtq keys revoke {key.id} ends it)", err=True)


@keys.command("list")
@click.option("--tenant", default=None, help="Only this tenant's keys.")
@redis_option
@json_option
def keys_list(tenant: str | None, url: str | None, as_json: bool) -> None:
    """The keys (revoked ones too), oldest first; never their secrets."""
    from rich.table import Table

    from mtq.client import apikeys as api

    client = connect_client(url, start=False)
    try:
        rows = api.list_keys(client, tenant)
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json([k.as_dict() for k in rows])
        return
    if not rows:
        console.print("no API keys" + (f" of tenant {shown(tenant)}" if tenant else "")
                      + "; make one with 'mtq keys create --tenant T'")
        return
    table = Table(title=f"{len(rows)} API key(s)")
    if any(k.admin for k in rows):
        table.caption = "* an admin key (it may act on the web dashboard)"
    for col in ("id", "tenant", "priority", "rpm", "tpm", "created", "revoked", "name"):
        table.add_column(col, no_wrap=col in ("id", "tenant"))
    for k in rows:
        table.add_row(k.id + ("*" if k.admin else ""), shown(k.tenant), k.priority or "-",
                      "-" if k.rpm is None else str(k.rpm),
                      "-" if k.tpm is None else str(k.tpm), _stamp(k.created),
                      _stamp(k.revoked), shown(k.name) or "-")
    console.print(table)


@keys.command("revoke")
@click.argument("key_id")
@redis_option
def keys_revoke(key_id: str, url: str | None) -> None:
    """Revoke the key KEY_ID (its id, as 'mtq keys list' shows it) from now on.
    Exit code 3 if no key has that id."""
    from mtq.client import apikeys as api

    client = connect_client(url, start=False)
    try:
        found = api.revoke(client, key_id)
    except MtqError as exc:
        fail_on(exc)
    if not found:
        fail(f"no API key has the id {key_id!r} (see 'mtq keys list')", NOT_FOUND)
    click.echo(f"revoked {printable(key_id)}")
