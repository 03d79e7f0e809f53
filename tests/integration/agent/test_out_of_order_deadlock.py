"""Out-of-order deadlock (docs/design.md): a pod that receives one object and sends the next never deadlocks.

Three workload processes A, B, C. Objects are chained A -> B -> C -> (A and B): B fetches
a_i from A and puts it as b_i, C fetches b_i and puts c_i, A and B fetch c_i. Every
request of every chain is issued at once from async code, in shuffled order, so
consumers usually ask for an object before its producer has it (they retry on 404 until
it appears, the way a borrower waits for an object). Ray deadlocked here when a metadata
request occupied the slot a receive needed; our metadata path (read tickets) never waits
on data, so every round completes within its bound. Repeated, with mixed sizes.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from gpuobj_agent.layouts import TensorLayout

from .conftest import settle

pytestmark = pytest.mark.nixl

ROUNDS = 12
CHAINS = 8
SIZES = [(16,), (1 << 10,), (1 << 16,), (1 << 18,)]  # float32 elements: 64 B .. 1 MiB


async def post(session: aiohttp.ClientSession, proc, path: str, body: dict) -> tuple[int, dict]:
    async with session.post(proc.url + path, json=body, headers=proc.headers) as resp:
        return resp.status, await resp.json()


async def one_round(session, a, b, c, rnd: int, rng: random.Random) -> None:
    expected = {}
    for i in range(CHAINS):
        layout = TensorLayout(rng.choice(SIZES), "float32", "cpu")
        status, body = await post(
            session, a, "/v1/test/put", {"id": f"a{rnd}-{i}", "tensors": [layout.to_json()], "seed": rnd * 100 + i}
        )
        assert status == 200, body
        expected[i] = body["digest"]

    def fetch(reader, source, oid: str, put_as: str | None = None):
        body = {"endpoint": source.endpoint, "id": oid, "token": reader.reader_token, "waitSeconds": 60}
        if put_as:
            body["putAs"] = put_as
        return post(session, reader, "/v1/test/fetch", body)

    jobs = []
    for i in range(CHAINS):
        jobs += [
            (i, fetch(b, a, f"a{rnd}-{i}", put_as=f"b{rnd}-{i}")),  # B: receiver of a_i, sender of b_i
            (i, fetch(c, b, f"b{rnd}-{i}", put_as=f"c{rnd}-{i}")),  # C: receiver of b_i, sender of c_i
            (i, fetch(a, c, f"c{rnd}-{i}")),  # A: the sender of a_i receives c_i
            (i, fetch(b, c, f"c{rnd}-{i}")),  # B: both directions between B and C
            (i, fetch(a, b, f"b{rnd}-{i}")),  # A <- B while B <- A
        ]
    rng.shuffle(jobs)
    async with asyncio.timeout(120):  # bounded: a deadlock fails here instead of hanging
        results = await asyncio.gather(*(job for _, job in jobs))
    for (i, _), (status, body) in zip(jobs, results, strict=True):
        assert status == 200, body
        assert body["digest"] == expected[i]
    for proc, prefix in ((a, "a"), (b, "b"), (c, "c")):
        for i in range(CHAINS):
            status, body = await post(session, proc, f"/v1/objects/{prefix}{rnd}-{i}/free", {})
            assert status == 200 and body["freed"], body


def test_chained_and_interleaved_transfers_among_three_agents_never_deadlock(make_process):
    a, b, c = (make_process(name, workload=True) for name in ("a", "b", "c"))
    rng = random.Random(2)

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            for rnd in range(ROUNDS):
                await one_round(session, a, b, c, rnd, rng)

    asyncio.run(main())
    for proc in (a, b, c):
        settle(proc.stats)
