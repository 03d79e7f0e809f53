"""The Dockerfile, checked statically (no Docker engine here, and no hadolint): the rules it promises.

Two targets (operator, agent); base images pinned by exact tag; a builder that makes the wheel and the
virtualenvs; final stages that copy a virtualenv, add no build tools and no pip cache, and run as a
numeric non-root user with the right ENTRYPOINT and a HEALTHCHECK.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import yaml

from gpuobj_contract import names
from tests.e2e.deploy.support import CHART, REPO

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
FINAL = {"operator": ["gpuobj", "operator"], "agent": ["gpuobj", "agent"]}
BUILD_TOOLS = re.compile(
    r"\b(gcc|g\+\+|clang|build-essential|make|cmake|ninja|cargo|rustc|git|curl|wget|"
    r"python3?-dev|python3?-pip|python3?-venv|lib\S+-dev|pip3? install|-m pip install)\b"
)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _logical_lines(text: str) -> list[str]:
    """Instructions with continuations joined and comments dropped (as Docker's parser does)."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    assert not current, "dangling line continuation"
    return lines


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert m, line
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda v: global_args[v[1] or v[2]], m[1])
            stages.append(Stage(base=base, name=m[2]))
        elif not stages:
            assert keyword == "ARG", f"only ARG may precede the first FROM: {line}"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append((keyword, args))
    return global_args, stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    _, parsed = parse(DOCKERFILE.read_text())
    names_ = [s.name for s in parsed]
    assert all(names_) and len(set(names_)) == len(names_), f"every stage is named once: {names_}"
    return {s.name: s for s in parsed}


def test_both_targets_exist(stages: dict[str, Stage]) -> None:
    assert set(FINAL) <= set(stages)


def test_every_external_base_image_is_pinned_by_an_exact_tag(stages: dict[str, Stage]) -> None:
    for stage in stages.values():
        if stage.base in stages:
            continue
        image, _, digest = stage.base.partition("@")
        tag = image.rpartition(":")[2] if ":" in image.split("/")[-1] else ""
        assert tag or digest, f"{stage.name}: untagged FROM {stage.base}"
        if tag:
            assert tag != "latest", f"{stage.name}: FROM {stage.base}"
            assert re.match(r"^\d+\.\d+\.\d+", tag), f"{stage.name}: {stage.base} is not an exact version tag"


def chain(stages: dict[str, Stage], target: str) -> list[Stage]:
    """The stages an image is made of: the target and the stages it is FROM, down to an external base."""
    out = [stages[target]]
    while out[-1].base in stages:
        out.append(stages[out[-1].base])
    return out


def _installs(stage: Stage) -> bool:
    return any(re.search(r"\bvenv\b|pip3? |-m pip ", r) for r in stage.all("RUN"))


def test_final_stages_use_the_promised_bases_and_no_builder(stages: dict[str, Stage]) -> None:
    """A final image starts from a clean base, possibly through runtime stages (cached layers), never a builder."""
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", chain(stages, "operator")[-1].base)
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", chain(stages, "agent")[-1].base)
    for target in FINAL:
        for stage in chain(stages, target):
            assert not _installs(stage), f"{target} is built on {stage.name}, which installs packages"


def test_builder_builds_a_wheel_and_virtualenvs_the_final_stages_copy(stages: dict[str, Stage]) -> None:
    runs = {name: " ".join(stage.all("RUN")) for name, stage in stages.items()}
    assert any("pip wheel" in r for r in runs.values()), "a stage builds the gpuobj wheel"
    final = {stage.name for target in FINAL for stage in chain(stages, target)}
    builders = {name for name, stage in stages.items() if _installs(stage) and name not in final}
    for target in FINAL:
        copies = [c for stage in chain(stages, target) for c in stage.all("COPY") if c.startswith("--from=")]
        sources = {c.split()[0].removeprefix("--from=") for c in copies}
        assert sources and sources <= builders, f"{target} copies what builders installed: {copies}"
    for name in stages:
        env = " ".join(s.all("ENV")[0] for s in chain(stages, name) if s.all("ENV"))
        for command in re.findall(r"pip3? (?:--python \S+ )?install[^&;]*|-m pip install[^&;]*", runs[name]):
            assert "--no-cache-dir" in command or "PIP_NO_CACHE_DIR=1" in env, f"{name}: pip cache kept: {command}"


def test_agent_dependencies_layer_depends_on_pyproject_only(stages: dict[str, Stage]) -> None:
    """torch's 6 GB are installed from pyproject.toml alone, so a source change does not reinstall them."""
    deps = [name for name, stage in stages.items() if any("optional-dependencies" in r for r in stage.all("RUN"))]
    assert len(deps) == 1, deps
    stage = chain(stages, deps[0])
    copies = [c for s in stage for c in s.all("COPY")]
    assert copies == ["pyproject.toml /src/pyproject.toml"], copies


def test_final_stages_carry_no_build_tools_and_no_pip_cache(stages: dict[str, Stage]) -> None:
    for target in FINAL:
        for command in (c for stage in chain(stages, target) for c in stage.all("RUN")):
            assert not BUILD_TOOLS.search(command), f"{target}: {command}"
            if "apt-get install" in command:
                assert "--no-install-recommends" in command and "rm -rf /var/lib/apt/lists/*" in command, command
            assert "pip" not in command.split(), f"{target} runs pip: {command}"


def test_final_stages_run_as_a_numeric_non_root_user(stages: dict[str, Stage]) -> None:
    for target in FINAL:
        users = stages[target].all("USER")
        assert users, f"{target} has no USER"
        m = re.fullmatch(r"(\d+)(?::(\d+))?", users[-1])
        assert m, f"{target}: USER {users[-1]} is not numeric (Kubernetes' runAsNonRoot needs a uid)"
        assert int(m[1]) != 0 and (m[2] is None or int(m[2]) != 0)
    chart_uid = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]["podSecurityContext"]["runAsUser"]
    assert stages["operator"].all("USER")[-1].split(":")[0] == str(chart_uid)


def test_entrypoints_ports_and_healthchecks(stages: dict[str, Stage]) -> None:
    metrics_port = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]["metricsPort"]
    ports = {"operator": str(metrics_port), "agent": str(names.DEFAULT_AGENT_PORT)}
    for target, entrypoint in FINAL.items():
        stage = stages[target]
        (declared,) = stage.all("ENTRYPOINT")
        assert json.loads(declared) == entrypoint, f"{target}: exec-form ENTRYPOINT {entrypoint}"
        assert stage.all("EXPOSE") == [ports[target]]
        (check,) = stage.all("HEALTHCHECK")
        assert "/healthz" in check and ports[target] in check, check


def _ignored(name: str, patterns: list[str]) -> bool:
    """Docker's rule for a top-level entry: the last matching pattern wins; `!` re-includes."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        if fnmatch.fnmatchcase(name, pattern):
            ignored = not negate
    return ignored


def test_dockerignore_sends_only_what_the_wheel_needs(stages: dict[str, Stage]) -> None:
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    for name in (".git", ".venv", "tests", "charts", "deploy", "bench", ".pytest_cache", "Dockerfile"):
        assert _ignored(name, patterns), f"{name} is sent to the Docker daemon"
    copied = [
        src
        for stage in stages.values()
        for args in stage.all("COPY")
        if not args.startswith("--from=")
        for src in args.split()[:-1]
    ]
    assert copied, "the builder copies the sources"
    for src in copied:
        assert (REPO / src).exists(), src
        assert not _ignored(src.rstrip("/").split("/")[0], patterns), f"COPY {src} but .dockerignore drops it"


def test_operator_image_needs_no_data_plane_packages() -> None:
    """The operator stage installs pyproject's dependencies without torch, nixl and numpy: it must not import them."""
    code = (
        "import sys, gpuobj.cli, gpuobj_operator.main\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'nixl', 'numpy'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
