"""A watch event is one JSON line, as long as the object it carries (issue 32).

Why a real server: the limit that broke this was aiohttp's, on the response reader (a line over 512 KiB
raised LineTooLong), so only a real HTTP response shows it. A GPUObject near the CRD's limits applied
with `kubectl apply` carries its spec twice (the last-applied annotation), well over that: its watch event
raised, the informer relisted, saw the same object, watched again and failed again, forever.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from gpuobj_kube.client import GPUOBJECTS, WATCH_LINE_LIMIT, KubeClient, WatchLineTooLong
from gpuobj_kube.config import KubeConfig


def _object(name: str, padding: int) -> dict:
    return {"metadata": {"name": name, "annotations": {"pad": "x" * padding}}}


async def _serve(lines: list[bytes]) -> tuple[web.AppRunner, str]:
    """An API server whose watch answers `lines` in small chunks, as a stream would arrive."""

    async def watch(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for line in lines:
            for i in range(0, len(line), 1 << 16):
                await resp.write(line[i : i + (1 << 16)])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get(GPUOBJECTS.path("ml"), watch)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def _events(lines: list[bytes]) -> list[tuple[str, dict]]:
    runner, url = await _serve(lines)
    kube = KubeClient(KubeConfig.static(url))
    try:
        events: AsyncIterator[tuple[str, dict]] = kube.watch(GPUOBJECTS, "ml")
        return [e async for e in events]
    finally:
        await kube.close()
        await runner.cleanup()


def _line(kind: str, obj: dict) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def test_an_event_as_large_as_the_api_server_stores_reaches_the_watch() -> None:
    """A 2 MiB event (etcd's default limit is 1.5 MiB per object) between two small ones: all three arrive."""
    big = _object("big", 2 << 20)
    got = asyncio.run(
        _events([_line("ADDED", _object("a", 10)), _line("ADDED", big), _line("DELETED", _object("b", 1))])
    )
    assert [(kind, obj["metadata"]["name"]) for kind, obj in got] == [
        ("ADDED", "a"),
        ("ADDED", "big"),
        ("DELETED", "b"),
    ]
    assert got[1][1] == big


def test_a_line_over_the_limit_says_so() -> None:
    """No API server sends one (the limit is over twice its largest request); a broken proxy might."""
    with pytest.raises(WatchLineTooLong, match="longer than"):
        asyncio.run(_events([_line("ADDED", _object("huge", WATCH_LINE_LIMIT + 10))]))
