"""One writer of NIXL placement: only nixl_state.py registers, deregisters or moves a stored object's regions.

Why: the ledger (registrations.py) is right only if every NIXL registration change goes through it in one
order under one lock; before this test the store, the pooled regions and the fencer each called NIXL and the
ledger themselves (issue 32). The fencer and the store decide when and what; NixlState's placement verbs do it.
Read from the source (no agent runs): tests/integration/agent exercises the verbs with real NIXL.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gpuobj_agent

PACKAGE = Path(gpuobj_agent.__file__).parent
OWNER = "nixl_state.py"
# What is not placement of a stored object: the ledger itself, the NIXL wrapper, the control-thread helpers
# the owner calls (objects.register_in), and a reader's landing buffers in its own reader agent.
NOT_PLACEMENT = {"registrations.py", "nixl_transport.py", "objects.py", "buffers.py"}
LEDGER_WRITES = {"acquire", "release", "rollback", "deregistered", "add_generation", "drop_generation"}
MEMBERS_WRITES = {"setdefault", "pop", "add", "discard", "update", "difference_update", "clear"}


def _attr_chain(node: ast.expr) -> list[str]:
    """`self.nixl.ledger.acquire` -> ["self", "nixl", "ledger", "acquire"] (names only)."""
    out: list[str] = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out[::-1]


def placement_writes(source: str) -> list[str]:
    """Every placement write in a module's source, as 'line: what'."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        # References, called or handed to the control thread (`await nixl.control(gen.agent.register, keys)`).
        if isinstance(node, ast.Name) and node.id == "register_in":
            found.append(f"{node.lineno}: register_in")
        elif isinstance(node, ast.Attribute):
            chain, verb = _attr_chain(node), node.attr
            owner = chain[-2] if len(chain) >= 2 else ""
            if owner == "ledger" and verb in LEDGER_WRITES:
                found.append(f"{node.lineno}: ledger.{verb}")
            elif owner == "agent" and verb in ("register", "deregister"):
                found.append(f"{node.lineno}: agent.{verb}")
            elif owner == "members" and verb in MEMBERS_WRITES:
                found.append(f"{node.lineno}: members.{verb}")
            elif node.attr in ("pooled_parked", "_pooled_parked"):
                found.append(f"{node.lineno}: {node.attr}")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "gid":
                    found.append(f"{node.lineno}: .gid =")
                if isinstance(target, ast.Subscript) and _attr_chain(target.value)[-1:] == ["members"]:
                    found.append(f"{node.lineno}: members[...] =")
    return found


def test_only_nixl_state_writes_where_a_stored_object_is_registered() -> None:
    writers = {
        path.name: writes
        for path in sorted(PACKAGE.glob("*.py"))
        if path.name not in NOT_PLACEMENT | {OWNER} and (writes := placement_writes(path.read_text()))
    }
    assert writers == {}, f"placement written outside {OWNER}: {writers}"


def test_the_check_sees_each_kind_of_write() -> None:
    """The guard above would catch what the fencer and the store used to do themselves."""
    source = """
async def f(self, gen, obj, keys, target):
    new = self.nixl.ledger.acquire(gen.gid, keys, "o")
    await self.nixl.control(register_in, gen.agent, new, [])
    await nixl.control(target.agent.register, new)
    nixl.ledger.release(gen.gid, "o")
    nixl.members.setdefault(gen.gid, set()).add("o")
    self.nixl.pooled_parked[tuple(keys)] = gen.gid
    obj.gid = target.gid
"""
    kinds = [w.split(": ", 1)[1] for w in placement_writes(source)]
    assert sorted(kinds) == sorted(
        [
            "ledger.acquire",
            "register_in",
            "agent.register",
            "ledger.release",
            "members.setdefault",
            "pooled_parked",
            ".gid =",
        ]
    )
    assert placement_writes(PACKAGE.joinpath(OWNER).read_text())  # the owner does write (the check is live)
