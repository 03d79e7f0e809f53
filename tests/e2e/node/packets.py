"""A capture of the pod network: a raw AF_PACKET socket on the node's bridge, in promiscuous mode.

Why on the bridge: every frame between two pods, and between a pod and the host, crosses it once; in
promiscuous mode the bridge passes the frames it forwards between its ports up to its own device, where a
packet socket sees them. The membership (and so promiscuous mode) ends when the socket closes: nothing is
left on the node. TCP payloads are kept per flow by sequence number (a retransmission counts once), so a
string split across two segments is still found. Standard library only; needs root, as the node does.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
SOL_PACKET = 263
PACKET_ADD_MEMBERSHIP = 1
PACKET_MR_PROMISC = 1
SO_RCVBUFFORCE = 33  # <asm-generic/socket.h>; the socket module does not name it

# A JWT: base64url of '{"' (header), a dot, base64url of '{"' (claims). Random bytes (NIXL moves megabytes of
# them) contain the three bytes `eyJ` every 16 MiB or so; this shape they do not.
JWT = re.compile(rb"eyJ[A-Za-z0-9_-]{4,}\.eyJ[A-Za-z0-9_-]{4,}")
BEARER = b"Bearer "


@dataclass(frozen=True)
class Flow:
    """One direction of one TCP connection."""

    src: str
    sport: int
    dst: str
    dport: int


@dataclass
class FlowData:
    packets: int = 0
    wire_bytes: int = 0
    segments: dict[int, bytes] = field(default_factory=dict)

    def payload(self) -> bytes:
        return b"".join(self.segments[s] for s in sorted(self.segments))


def parse_tcp(frame: bytes) -> tuple[Flow, int, bytes] | None:
    """(flow, sequence number, payload) of an Ethernet/IPv4/TCP frame; None for anything else."""
    if len(frame) < 14 + 20 or struct.unpack("!H", frame[12:14])[0] != ETH_P_IP:
        return None
    ip = frame[14:]
    ihl = (ip[0] & 0x0F) * 4
    total = struct.unpack("!H", ip[2:4])[0]
    if ip[9] != socket.IPPROTO_TCP or len(ip) < ihl + 20:
        return None
    tcp = ip[ihl : total if total else len(ip)]  # a GRO frame may carry total 0: take what arrived
    sport, dport, seq = struct.unpack("!HHI", tcp[:8])
    offset = (tcp[12] >> 4) * 4
    flow = Flow(socket.inet_ntoa(ip[12:16]), sport, socket.inet_ntoa(ip[16:20]), dport)
    return flow, seq, bytes(tcp[offset:])


def is_client_hello(payload: bytes) -> bool:
    """A TLS handshake record (0x16, version 3.x) whose first message is a ClientHello (1)."""
    return len(payload) >= 6 and payload[0] == 0x16 and payload[1] == 0x03 and payload[5] == 0x01


def is_tls_record(payload: bytes) -> bool:
    """Starts a TLS record: content type 20-23 (change cipher spec, alert, handshake, data), version 3.x.

    A keep-alive connection opened before the capture began shows no ClientHello, only records."""
    return len(payload) >= 5 and 0x14 <= payload[0] <= 0x17 and payload[1] == 0x03


class Capture:
    """Captures TCP on `interface` from start until stop (a context manager); keeps flows touching `subnet`."""

    def __init__(self, interface: str, subnet: str) -> None:
        self.interface = interface
        self.subnet = ipaddress.ip_network(subnet)
        self.flows: dict[Flow, FlowData] = {}
        self.frames = 0
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
        self._sock.bind((interface, 0))
        mreq = struct.pack("iHH8s", socket.if_nametoindex(interface), PACKET_MR_PROMISC, 0, b"")
        self._sock.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, mreq)
        self._sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._read, name="capture", daemon=True)

    def __enter__(self) -> Capture:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._sock.close()

    def _read(self) -> None:
        """Until stopped, then until the socket's buffer is drained (a quiet 0.2 s, 5 s at most)."""
        drain_until: float | None = None
        while drain_until is None or time.monotonic() < drain_until:
            if drain_until is None and self._stop.is_set():
                drain_until = time.monotonic() + 5
            try:
                frame = self._sock.recv(262144)
            except TimeoutError:
                if self._stop.is_set():
                    return
                continue
            except OSError:
                return
            self.frames += 1
            parsed = parse_tcp(frame)
            if parsed is None:
                continue
            flow, seq, payload = parsed
            if not (ipaddress.ip_address(flow.src) in self.subnet or ipaddress.ip_address(flow.dst) in self.subnet):
                continue
            data = self.flows.setdefault(flow, FlowData())
            data.packets += 1
            data.wire_bytes += len(frame)
            if payload:
                data.segments[seq] = payload

    def on_port(self, port: int) -> Iterator[tuple[Flow, FlowData]]:
        """Both directions of every connection to `port`."""
        return ((f, d) for f, d in self.flows.items() if port in (f.sport, f.dport))

    def find(self, pattern: re.Pattern[bytes] | bytes) -> list[Flow]:
        """The flows whose reassembled payload contains `pattern`."""
        rx = pattern if isinstance(pattern, re.Pattern) else re.compile(re.escape(pattern))
        return [f for f, d in self.flows.items() if rx.search(d.payload())]
