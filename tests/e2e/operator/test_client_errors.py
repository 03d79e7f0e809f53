"""What a workload meets when it gets things wrong: one hierarchy under gpuobj.GpuObjError, with advice.

Real workload processes (client library + embedded agent) against the real API server and operator;
each mistake changes nothing, and the test ends with nothing held.
"""

from __future__ import annotations

import pytest

from gpuobj_dev.testing import agent_http
from gpuobj_dev.testing.cluster import ClusterHandle
from gpuobj_dev.testing.operator import OperatorProcess
from tests.e2e.operator.conftest import Pods
from tests.e2e.operator.test_lifecycle import assert_api_empty, wait_object

pytestmark = pytest.mark.nixl

CATCH = """
try:
    {stmt}
    err = None
except gpuobj.GpuObjError as e:
    err = [type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e)]
"""


def attempt(workload, stmt: str) -> list | None:
    workload.run(CATCH.format(stmt=stmt))
    return workload.eval("err")


def test_mistakes_raise_gpuobj_errors_that_say_what_to_do_and_change_nothing(
    gpuobj_cluster: ClusterHandle, namespace: str, operator: OperatorProcess, pods: Pods, token_file
) -> None:
    src, reader = pods.workload("src"), pods.workload("reader")
    src.run("import gpuobj")

    name, mro, message = attempt(src, "client.put([1, 2, 3])")
    assert name == "InvalidTensorError" and "ValueError" in mro and "torch.Tensor" in message

    name, _, message = attempt(src, "client.put(torch.ones(4, 4).t())")  # non-contiguous
    assert name == "InvalidTensorError" and "copy=True" in message
    src.run("t_ref = client.put(torch.arange(16.0).reshape(4, 4).t(), name='transposed', copy=True)")
    wait_object(gpuobj_cluster, namespace, "transposed", lambda o: (o or {}).get("status", {}).get("state") == "Ready")

    name, _, message = attempt(src, "client.put([torch.ones(4)], name='transposed')")
    assert name == "NameTakenError" and "another name" in message

    # A share is queued like a put (no API read on the caller's path): the next flush says the pod is missing.
    src.run("mistaken = client.share(t_ref, 'no-such-pod')")
    name, _, message = attempt(src, "client.flush(30)")
    assert name == "PodNotFoundError" and "no-such-pod" in message

    shared = src.eval_pickle("client.share(t_ref, 'reader')")
    reader.run("import gpuobj")
    reader.run(f"h = client.adopt(load_pickle({shared!r})); got = client.fetch(h)[0]")
    assert reader.eval("got.tolist()") == [[float(4 * j + i) for j in range(4)] for i in range(4)]
    reader.run("h.release()")
    # The owner's reference still keeps the bytes, but this handle no longer holds one.
    name, _, message = attempt(reader, "client.fetch(h)")
    assert name == "ReleasedHandleError" and "released" in message
    name, _, _ = attempt(reader, "client.borrow(h)")
    assert name == "ReleasedHandleError"

    src.run("t_ref.release()")
    wait_object(gpuobj_cluster, namespace, "transposed", lambda o: o is None)
    agent_http.assert_holds_nothing(pods.endpoint("src"), token_file)
    agent_http.assert_holds_nothing(pods.endpoint("reader"), token_file)
    assert_api_empty(gpuobj_cluster, namespace)
