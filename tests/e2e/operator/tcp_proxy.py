"""A TCP proxy between a workload and the API server that a test can take down and bring back.

Why: an API outage seen by one client, with the real API server (and the operator) still up.
While down the port refuses connections and open ones are cut, as when an API server dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import yaml


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tcp-proxy", daemon=True)
        self._thread.start()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._conns.update((writer, up_writer))
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._conns.difference_update((writer, up_writer))

    async def _up(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _down(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in list(self._conns):
            w.close()
        self._conns.clear()

    def up(self) -> TcpProxy:
        self._call(self._up())
        return self

    def down(self) -> None:
        self._call(self._down())

    async def _cancel_connections(self) -> None:
        """Every connection's task: cancelled and awaited, so none outlives the proxy."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.down()
        with contextlib.suppress(Exception):
            self._call(self._cancel_connections())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()

    def kubeconfig(self, original: Path, out: Path) -> Path:
        """A copy of `original` whose server is this proxy (same host IP, so TLS still verifies)."""
        config = yaml.safe_load(original.read_text())
        for cluster in config["clusters"]:
            cluster["cluster"]["server"] = f"https://127.0.0.1:{self.port}"
        out.write_text(yaml.safe_dump(config))
        return out


def server_address(kubeconfig: Path) -> tuple[str, int]:
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    hostport = server.split("://", 1)[1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    return host, int(port)
