"""The leaked-bytes dashboard: generated from code, committed in sync, complete and well-formed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpuobj_contract import metric_names as m
from gpuobj_dev.observability import dashboard, queries

REPO = Path(__file__).resolve().parents[3]


def contract_metrics() -> set[str]:
    return {v for k, v in vars(m).items() if k.isupper() and isinstance(v, str) and v.startswith("gpuobj_")} - {
        m.PREFIX
    }


def committed() -> dict:
    return json.loads(dashboard.OUTPUT.read_text())


def test_committed_dashboard_is_what_the_code_generates() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpuobj_dev.observability.dashboard", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_fails_when_the_committed_file_is_stale(tmp_path: Path) -> None:
    stale = tmp_path / "dashboard.json"
    stale.write_text(dashboard.render().replace("gpuobj_leaked_bytes", "gpuobj_leaked_bytez"))
    assert dashboard.main(["--check", "--output", str(stale)]) == 1
    assert dashboard.main(["--write", "--output", str(stale)]) == 0
    assert dashboard.main(["--check", "--output", str(stale)]) == 0


def test_every_query_reads_only_contract_metrics_and_every_contract_metric_is_shown() -> None:
    used: set[str] = set()
    for title, expr in dashboard.panel_queries():
        names = queries.referenced_metrics(expr)
        assert names, f"{title}: {expr} reads no gpuobj metric"
        assert names <= contract_metrics(), (
            f"{title}: {names - contract_metrics()} not in contract/gpuobj_contract/metric_names.py"
        )
        used |= names
    assert contract_metrics() - used == set(), "contract metrics without a panel"


def test_leaked_bytes_by_namespace_and_pod_is_the_first_panel() -> None:
    panels = committed()["panels"]
    assert panels[0]["type"] == "row" and panels[0]["title"] == "Leaked bytes"
    first = panels[1]
    assert first["title"] == "Leaked bytes by namespace and pod"
    assert first["gridPos"]["y"] == 1 and first["gridPos"]["x"] == 0
    assert first["targets"][0]["expr"] == f"max by (namespace, pod) ({m.LEAKED_BYTES})"
    assert first["fieldConfig"]["defaults"]["unit"] == "bytes"


def test_panels_have_the_datasource_variable_units_descriptions_and_no_overlap() -> None:
    board = committed()
    (var,) = board["templating"]["list"]
    assert (var["type"], var["name"], var["query"]) == ("datasource", "datasource", "prometheus")
    occupied: set[tuple[int, int]] = set()
    ids = set()
    for panel in board["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        g = panel["gridPos"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        assert g["x"] + g["w"] <= 24
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert len(panel["description"]) > 40, panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"] in {"bytes", "binBps", "s", "ops", "short"}
        assert [t["refId"] for t in panel["targets"]] == [chr(ord("A") + i) for i in range(len(panel["targets"]))]


def test_panels_expected_by_the_design_exist() -> None:
    titles = {t for t, _ in dashboard.panel_queries()}
    for expected in (
        "Leaked bytes by namespace and pod",
        "Bytes by state",
        "Objects by state",
        "Free latency p50 / p99",
        "Frees by result",
        "Free failures by reason",
        "Reclaimed bytes by namespace",
        "NIXL-registered vs stored bytes per agent",
        "Transfer throughput",
    ):
        assert expected in titles
    latency = [e for t, e in dashboard.panel_queries() if t == "Free latency p50 / p99"]
    assert latency == [
        f"histogram_quantile(0.5, sum by (le) (rate({m.FREE_LATENCY}_bucket[$__rate_interval])))",
        f"histogram_quantile(0.99, sum by (le) (rate({m.FREE_LATENCY}_bucket[$__rate_interval])))",
    ]


def test_grafana_macros_are_replaced_for_prometheus() -> None:
    expr = "sum(rate(x[$__rate_interval])) + sum(increase(y[$__range])) + z[$__interval]"
    assert queries.for_prometheus(expr, rate_interval="5s", range_="1m", interval="2s") == (
        "sum(rate(x[5s])) + sum(increase(y[1m])) + z[2s]"
    )
