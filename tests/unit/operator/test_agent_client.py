"""The operator reads an agent's whole answer, or fails: never a cut answer read as an empty store.

A local aiohttp server plays an agent that writes its answer slowly, in pieces (what a large
inventory does over a real socket); the real agent's paging is driven end to end in
tests/e2e/operator/test_audit_at_size.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from gpuobj_contract import agent_api as api
from gpuobj_operator.agent_client import AgentClient, AgentError

IDENTITY = {"pod": "src", "namespace": "ml", "podUID": "uid-1", "incarnation": "i-1"}


def _items(n: int) -> list[dict]:
    return [
        {"id": f"o-{i:05d}", "bytes": 16, "createdAt": f"2026-12-02T04:00:{i % 60:02d}.000Z", "ageSeconds": 9.0}
        for i in range(n)
    ]


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get(api.INVENTORY.template, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def _slowly(request: web.Request, body: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    for i in range(0, len(body), 16 << 10):  # what the socket delivers: pieces, with gaps between them
        await resp.write(body[i : i + (16 << 10)])
        await asyncio.sleep(0.001)
    await resp.write_eof()
    return resp


def _run(handler, check) -> None:
    async def go() -> None:
        runner, endpoint = await _serve(handler)
        client = AgentClient(None)
        try:
            await check(client, endpoint)
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(go())


def test_a_large_inventory_written_in_pieces_is_read_whole_page_by_page() -> None:
    held = _items(2500)  # ~200 KB of JSON, over what one read of the socket returns
    seen_limits: list[str] = []

    async def pages(request: web.Request) -> web.StreamResponse:
        seen_limits.append(request.query["limit"])
        ordered = sorted(held, key=api.inventory_order)
        start = 0
        if "continue" in request.query:
            after = api.parse_inventory_token(request.query["continue"])
            start = next(i for i, o in enumerate(ordered) if api.inventory_order(o) > after)
        page = ordered[start : start + int(request.query["limit"])]
        answer = {**IDENTITY, "objects": page}
        if start + len(page) < len(ordered):
            answer["continue"] = api.inventory_token(page[-1])
        return await _slowly(request, json.dumps(answer).encode())

    async def check(client: AgentClient, endpoint: str) -> None:
        inventory = await client.inventory(endpoint, pod_uid="uid-1", page=1000)
        assert sorted(o.id for o in inventory.objects) == sorted(o["id"] for o in held)
        assert inventory.pod_uid == "uid-1" and inventory.continue_token == ""

    _run(pages, check)
    assert seen_limits == ["1000", "1000", "1000"]


def test_one_answer_of_half_a_megabyte_is_read_whole() -> None:
    body = json.dumps({**IDENTITY, "objects": _items(6000)}).encode()
    assert len(body) > 400_000

    async def whole(request: web.Request) -> web.StreamResponse:
        return await _slowly(request, body)

    async def check(client: AgentClient, endpoint: str) -> None:
        inventory = await client.inventory(endpoint, pod_uid="uid-1", page=api.MAX_INVENTORY_PAGE)
        assert len(inventory.objects) == 6000

    _run(whole, check)


@pytest.mark.parametrize(
    "body",
    [
        json.dumps({**IDENTITY, "objects": _items(50)}).encode()[:-300],  # cut short
        json.dumps({"objects": _items(3)}).encode(),  # no identity
        json.dumps({**IDENTITY}).encode(),  # no objects list
        b"",
    ],
    ids=["cut", "no-identity", "no-objects", "empty"],
)
def test_a_short_or_invalid_inventory_is_an_error_never_an_empty_store(body: bytes) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        return await _slowly(request, body)

    async def check(client: AgentClient, endpoint: str) -> None:
        with pytest.raises(AgentError) as refused:
            await client.inventory(endpoint, pod_uid="uid-1")
        assert refused.value.status == 502

    _run(answer, check)


def test_pages_from_two_processes_are_refused() -> None:
    incarnations = iter(["i-1", "i-2"])

    async def restarted(request: web.Request) -> web.StreamResponse:
        answer = {**IDENTITY, "incarnation": next(incarnations), "objects": _items(1)}
        if "continue" not in request.query:
            answer["continue"] = api.inventory_token(answer["objects"][0])
        return web.json_response(answer)

    async def check(client: AgentClient, endpoint: str) -> None:
        with pytest.raises(AgentError, match="changed process"):
            await client.inventory(endpoint, pod_uid="uid-1", page=1)

    _run(restarted, check)
