"""Reading an HTTP answer's whole body, bounded: the one way gpuobj reads a body it must parse.

``aiohttp``'s ``resp.content.read(n)`` returns what is buffered so far, up to ``n`` bytes, not the
whole body: a 151 KB agent inventory once came back cut and parsed as an empty store, and a
TokenReview answer split over two TCP segments parsed as "Unterminated string". Every body gpuobj
parses as JSON goes through :func:`read_bounded` instead.
"""

from __future__ import annotations

import aiohttp


class BodyTooLarge(ValueError):
    """The answer is larger than the reader allows: refused, not read."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"{what} answered more than {limit} bytes")
        self.limit = limit


async def read_bounded(resp: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
    """The whole body of ``resp``, at most ``limit`` bytes (``what`` names the peer in the error)."""
    if resp.content_length is not None and resp.content_length > limit:
        raise BodyTooLarge(what, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(what, limit)
        chunks.append(chunk)
    return b"".join(chunks)
