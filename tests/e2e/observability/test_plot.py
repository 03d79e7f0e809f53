"""The bytes-over-time PNG: drawn from a real Prometheus' range queries."""

from __future__ import annotations

import struct
import time
from pathlib import Path

from matplotlib.colors import to_rgb
from matplotlib.image import imread
from prometheus_client import CollectorRegistry, Gauge

from gpuobj_contract import metric_names as m
from gpuobj_dev.observability.plot import MIB, PHASE_COLOURS, SERIES, plot_bytes
from gpuobj_dev.testing.prometheus import Prometheus, sample_value
from tests.e2e.observability.conftest import Exporter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_bytes_writes_a_png_of_the_series_prometheus_scraped(exporter: Exporter, tmp_path: Path) -> None:
    # A stand-in exporter with the plotted series' names: this test checks the drawing (queries, axes,
    # PNG), not the agent; the dashboard test against real exporters covers where the numbers come from.
    registry = CollectorRegistry()
    stored = Gauge(m.AGENT_STORE_BYTES, "stand-in", ["device"], registry=registry).labels("cpu")
    registered = Gauge(m.AGENT_NIXL_REGISTERED_BYTES, "stand-in", registry=registry)
    leaked = Gauge(m.LEAKED_BYTES, "stand-in", ["namespace", "pod"], registry=registry).labels("ml", "producer-0")
    with Prometheus({"gpuobj-agent": [exporter(registry)]}) as prom:
        start = time.time()
        for step in (64 * MIB, 16 * MIB, 0):  # stored and registered fall back to zero; a leak stays
            stored.set(step)
            registered.set(step)
            leaked.set(0 if step else 8 * MIB)
            prom.wait_for_series(
                f"sum({m.AGENT_STORE_BYTES})", lambda r, v=step: bool(r) and sample_value(r[0]) == v, timeout=20
            )
        prom.wait_for_series(f"sum({m.LEAKED_BYTES})", lambda r: bool(r) and sample_value(r[0]) == 8 * MIB, 20)
        end = time.time()
        for _, expr, _ in SERIES:
            assert prom.query_range(expr, start, end, 1), expr

        out = plot_bytes(prom, start, end, tmp_path / "plots" / "bytes.png")

    assert out == tmp_path / "plots" / "bytes.png"
    assert png_size(out) == (900, 450)
    pixels = imread(out)
    assert pixels.shape[:2] == (450, 900)


def test_plot_bytes_without_data_still_writes_a_png(tmp_path: Path) -> None:
    with Prometheus({}) as prom:
        now = time.time()
        out = plot_bytes(prom, now - 30, now, tmp_path / "empty.png")
    assert png_size(out) == (900, 450)


def test_plot_bytes_shades_and_labels_the_phases(tmp_path: Path) -> None:
    """A run's steps (the demo's phases) appear as grey spans under the lines; none without phases."""
    with Prometheus({}) as prom:
        now = time.time()
        plain = plot_bytes(prom, now - 30, now, tmp_path / "plain.png")
        phased = plot_bytes(
            prom,
            now - 30,
            now,
            tmp_path / "phased.png",
            phases=[("put", now - 25, now - 15), ("freed", now - 15, now - 5)],
        )

    def shaded(path: Path) -> int:
        rgb = imread(path)[..., :3]
        return sum(int((abs(rgb - to_rgb(c)) < 0.003).all(axis=-1).sum()) for c in PHASE_COLOURS)

    assert shaded(plain) == 0
    assert shaded(phased) > 10_000  # two spans of a third of the axes each
