"""The chaos suite: seeded lifecycles with a fault each, then every leak-freedom property checked after quiescence.

Reproduce a run with its seed: ``GPUOBJ_CHAOS_SEED=<seed> .venv/bin/python -m pytest tests/e2e/chaos -s``
(``GPUOBJ_CHAOS_LIFECYCLES`` sets how many; default: every fault kind once, plus two drawn at random).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.chaos import FAULTS, Chaos, Schedule, fetch_as_expected, table
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.waits import wait_until
from tests.e2e.operator.conftest import Pods, start_operator

pytestmark = pytest.mark.nixl

SENTINEL = "torch.arange(1 << 18, dtype=torch.float32)"


@pytest.mark.timeout(900)
def test_chaos_every_lifecycle_is_cleaned_and_nothing_is_freed_wrongly(
    gpuobj_cluster: ClusterHandle, namespace: str, token_file: Path, pods: Pods, capsys: pytest.CaptureFixture
) -> None:
    seed = int(os.environ.get("GPUOBJ_CHAOS_SEED") or random.SystemRandom().randrange(1 << 32))
    schedule = Schedule.make(seed, int(os.environ.get("GPUOBJ_CHAOS_LIFECYCLES", len(FAULTS) + 2)))
    with capsys.disabled():
        print(f"\nchaos: seed {seed} (GPUOBJ_CHAOS_SEED={seed} reproduces it), {schedule.lifecycles} lifecycles")

    chaos = Chaos(
        gpuobj_cluster,
        namespace,
        token_file,
        pods,
        lambda: start_operator(gpuobj_cluster, token_file, namespace, identity="op-chaos"),
    )
    outcomes = []
    try:
        chaos.operator.current.wait_ready()
        # The sentinel: recorded, held by its owner throughout, never faulted. A wrong free shows here.
        keep = chaos.start_pods("sentinel", "checker")
        sentinel, checker = keep["sentinel"], keep["checker"]
        sentinel.run(f"keep = client.put([{SENTINEL}], name='sentinel')")
        address = sentinel.eval_pickle("keep.address")

        for index, (fault, point) in enumerate(schedule.plan):
            outcome = chaos.lifecycle(index, fault, point)
            outcomes.append(outcome)
            with capsys.disabled():
                print(table([outcome]).splitlines()[1], flush=True)
            if not outcome.cleaned:
                break  # what it left would blur every later lifecycle: stop here, with its evidence

        # Quiescence: the operator is up and the API answers; leaks are counted, then reclaimed.
        op = chaos.operator.ensure()
        op.wait_ready()
        objects, claims = chaos.api_records()
        # No finalizer stuck: only the sentinel is left, alive, with no claim.
        assert [o["metadata"]["name"] for o in objects] == ["sentinel"] and claims == [], (objects, claims)
        # Every byte a live store holds is recorded (or counted as leaked, and then reclaimed).
        recorded = {o["spec"]["objectId"] for o in objects}
        for w in (sentinel, checker):
            assert {o["id"] for o in chaos.holds(w)} <= recorded
        wait_until(lambda: op.metric("gpuobj_audit_runs_total", {"result": "ok"}) >= 2, "two audits", timeout=30)
        wait_until(lambda: op.metric("gpuobj_leaked_bytes") == 0, "leaked bytes back to 0", timeout=30)
        # No wrong free: the sentinel reads back exactly, through everything above.
        checker.run(f"h = client.borrow(load_pickle({address!r})); got = client.fetch(h)[0]; h.release()")
        assert checker.eval(f"bool(torch.equal(got, {SENTINEL}))")
        sentinel.run("keep.release()")
        wait_until(lambda: chaos.api_records() == ([], []), "the sentinel freed", timeout=30)
        agent_http.assert_holds_nothing(sentinel.endpoint, token_file)
        agent_http.assert_holds_nothing(checker.endpoint, token_file)
    finally:
        report = table(outcomes)
        restarts = f"operator restarts: {chaos.operator.restarts} (exit codes {chaos.operator.exits})"
        with capsys.disabled():
            print(f"\nchaos seed {seed}\n{report}\n{restarts}", flush=True)
        chaos.resume_all()
        rc = chaos.operator.stop()
    failed = [o for o in outcomes if not o.cleaned or not o.counters.startswith(("exact", "skipped"))]
    assert not failed, f"seed {seed}: lifecycles not clean:\n{report}"
    wrong = [o for o in outcomes if not fetch_as_expected(o)]
    assert not wrong, f"seed {seed}: a reader got wrong bytes or the wrong error:\n{report}"
    # A put made while the API server was down is recorded once it is back, 403s of its restart included.
    refused = [o for o in outcomes if "then refused" in o.note]
    assert not refused, f"seed {seed}: a put during an API outage was refused:\n{report}"
    assert rc == 0, chaos.operator.current.output()
