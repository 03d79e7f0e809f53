"""The control server's Protocols match what the agent hands it (no type checker runs here, so this does).

The routes themselves run against real agents in tests/integration/agent/test_api.py.
"""

from __future__ import annotations

import inspect

import pytest

from gpuobj_agent.agent import Agent
from gpuobj_agent.auth import ServiceAccountAuth
from gpuobj_agent.reads import Reads
from gpuobj_agent.server import Authenticator, Objects, Reading, Served
from gpuobj_agent.store import ObjectStore


def members(proto: type) -> dict[str, object]:
    return {n: v for n, v in vars(proto).items() if not n.startswith("_")}


@pytest.mark.parametrize(
    ("proto", "impl"), [(Objects, ObjectStore), (Reading, Reads), (Authenticator, ServiceAccountAuth)]
)
def test_every_member_the_server_calls_exists_with_the_same_shape(proto: type, impl: type) -> None:
    for name, wanted in members(proto).items():
        have = getattr(impl, name, None)
        assert have is not None, f"{impl.__name__} lacks {name}"
        if isinstance(wanted, property):
            assert isinstance(have, property), f"{impl.__name__}.{name} should be a property"
            continue
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(wanted), name
        assert list(inspect.signature(have).parameters) == list(inspect.signature(wanted).parameters), name


def test_the_agent_offers_what_the_server_needs() -> None:
    source = inspect.getsource(Agent.__init__)
    for name, wanted in members(Served).items():
        if isinstance(wanted, property):
            assert f"self.{name} =" in source or f"self.{name}: " in source, f"Agent never sets {name}"
        else:
            assert callable(getattr(Agent, name, None)), f"Agent lacks {name}()"
