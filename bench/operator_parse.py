"""What one watch event costs the operator in Python: a body parsed into a ledger record through the
contract's typed shapes (gpuobj_operator.model), then the ledger update and the object's decision.

No server: the bodies are what the API server sends for a Ready GPUObject (one tensor, two
conditions, a transport) and a Bound claim. Each figure is the best of 5 runs of N events, in
microseconds per event; on a shared machine the best run is the one least disturbed.

Usage: .venv/bin/python bench/operator_parse.py [--events 20000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import timeit
from collections.abc import Callable
from typing import Any

from gpuobj_contract import names
from gpuobj_operator.decisions import decide_object
from gpuobj_operator.ledger import Ledger
from gpuobj_operator.model import PodInfo, parse_claim, parse_object


def _condition(kind: str) -> dict[str, Any]:
    return {"type": kind, "status": "True", "lastTransitionTime": "t", "reason": "r", "message": "m"}


OBJECT = {
    "metadata": {
        "namespace": "ml",
        "name": "w",
        "uid": "u-1",
        "resourceVersion": "7",
        "generation": 1,
        "finalizers": [names.FINALIZER_FREE],
        "creationTimestamp": "2026-12-01T12:00:00Z",
    },
    "spec": {
        "source": {"podName": "src", "podUID": "p-1", "incarnation": "i-1"},
        "tensors": [{"shape": [4096, 4096], "dtype": "float16", "device": "cuda:0"}],
        "objectId": "o-1",
    },
    "status": {
        "state": "Ready",
        "objectId": "o-1",
        "bytes": 33554432,
        "tensorCount": 1,
        "references": 2,
        "claims": 1,
        "sourcePodUID": "p-1",
        "transport": {"backend": "nixl", "agentEndpoint": "10.0.0.5:8471", "agentIncarnation": "i-1"},
        "conditions": [_condition(names.CONDITION_READY), _condition(names.CONDITION_SOURCE_AVAILABLE)],
    },
}
CLAIM = {
    "metadata": {"namespace": "ml", "name": "c", "uid": "c-1", "resourceVersion": "8"},
    "spec": {"objectName": "w", "objectUID": "u-1", "holder": {"podName": "r", "incarnation": "i-2"}},
    "status": {"state": "Bound", "objectUID": "u-1", "bytes": 33554432, "sourcePod": "src", "conditions": []},
}


def per_event_us(fn: Callable[[], object], events: int) -> float:
    return min(timeit.repeat(fn, number=events, repeat=5)) / events * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20000)
    args = parser.parse_args()
    ledger = Ledger()
    ledger.synced = True
    ledger.upsert_pod(PodInfo("ml", "src", "p-1", phase="Running", endpoint="10.0.0.5:8471"))
    now = dt.datetime.now(dt.UTC)

    def object_event() -> object:
        info = parse_object(OBJECT)
        ledger.upsert_object(info, 1.0)
        return decide_object(ledger, info.key, now)

    print(f"parse_object                      {per_event_us(lambda: parse_object(OBJECT), args.events):7.1f} us")
    print(f"parse_claim                       {per_event_us(lambda: parse_claim(CLAIM), args.events):7.1f} us")
    print(f"object event: parse+upsert+decide {per_event_us(object_event, args.events // 4):7.1f} us")


if __name__ == "__main__":
    main()
