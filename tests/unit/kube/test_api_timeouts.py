"""An API request that gets no answer is reported as what it is: ApiTimeout naming the request.

Why a real socket: the timeout comes from aiohttp reading a server that accepted the connection
and never answered (an API server stuck on etcd, a black-holed route).
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from gpuobj.client.loop import LoopThread
from gpuobj_kube.client import GPUOBJECTS, ApiError, ApiTimeout, KubeClient
from gpuobj_kube.config import KubeConfig


@pytest.fixture
def silent_server():
    """Accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for conn in accepted:
        conn.close()
    server.close()


def test_a_request_without_an_answer_raises_api_timeout_naming_it(silent_server: str) -> None:
    async def go() -> None:
        config = KubeConfig.static(silent_server)
        kube = KubeClient(config, request_timeout=0.2)
        try:
            await kube.get(GPUOBJECTS, "w", "ml")
        finally:
            await kube.close()

    with pytest.raises(ApiTimeout) as info:
        asyncio.run(go())
    assert "GET /apis/gpuobj.io/v1alpha1/namespaces/ml/gpuobjects/w" in str(info.value)
    assert "no answer from the API server" in str(info.value)
    assert isinstance(info.value, ApiError) and isinstance(info.value, TimeoutError)


def test_the_client_loop_reports_the_operation_s_own_timeout_not_its_deadline() -> None:
    async def api_timed_out() -> None:
        raise ApiTimeout(0, "Timeout", "GET /x: no answer from the API server in 30s")

    async def hangs() -> None:
        await asyncio.Event().wait()

    loop = LoopThread()
    try:
        with pytest.raises(ApiTimeout, match="no answer from the API server"):
            loop.call(api_timed_out(), timeout=60)
        with pytest.raises(TimeoutError, match="did not finish within"):
            loop.call(hangs(), timeout=0.1)
    finally:
        loop.stop()
