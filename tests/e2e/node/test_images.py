"""The Dockerfile built for real with buildah (stand-in bases, `--pull=never`), and its images run with podman.

Why: the Dockerfile's static checks (tests/e2e/deploy/test_dockerfile.py) cannot tell whether it builds or
whether the operator starts as its non-root user. Base images cannot be pulled here, so gpuobj_dev.images
builds stand-ins under the names the FROM lines use; every layer is cached under ~/.cache/gpuobj/images.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from gpuobj_dev import images
from tests.e2e.deploy.support import REPO

pytestmark = [
    pytest.mark.node,
    pytest.mark.skipif(images.check_host() is not None, reason=str(images.check_host())),
    pytest.mark.timeout(3600),
]


def podman_run(image: str, *args: str, entrypoint: str | None = None) -> subprocess.CompletedProcess:
    """Run a container the way a restricted pod would: no network, read-only root, all capabilities dropped."""
    cmd = ["podman", "run", "--rm", "--network=none", "--read-only", "--cap-drop=ALL", "--no-healthcheck"]
    cmd += ["--security-opt=no-new-privileges"]
    if entrypoint:
        cmd += ["--entrypoint", entrypoint]
    return subprocess.run([*cmd, image, *args], env=images.container_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def operator_image() -> str:
    (result,) = images.ensure(["operator"], quiet=True)
    return result.image


def test_standins_carry_the_names_the_dockerfile_pulls() -> None:
    """The stand-ins are built under exactly the Dockerfile's ARG defaults, so the Dockerfile stays unchanged."""
    text = (REPO / "Dockerfile").read_text()
    defaults = dict(re.findall(r"^ARG (\w+_IMAGE)=(\S+)$", text, flags=re.M))
    assert f"docker.io/library/{defaults['PYTHON_IMAGE']}" == images.PYTHON_IMAGE
    assert f"docker.io/{defaults['CUDA_IMAGE']}" == images.CUDA_IMAGE


def test_operator_image_starts_as_its_non_root_user(operator_image: str) -> None:
    help_run = podman_run(operator_image, "--help")
    assert help_run.returncode == 0, help_run.stderr
    assert help_run.stdout.startswith("usage: gpuobj operator")
    ident = podman_run(operator_image, "-u", entrypoint="id")
    assert ident.returncode == 0, ident.stderr
    assert ident.stdout.strip() == "65532"


def test_operator_image_has_no_data_plane_and_no_pip(operator_image: str) -> None:
    probe = (
        "import importlib.util as u, json; "
        "print(json.dumps({m: bool(u.find_spec(m)) for m in "
        "('torch', 'nixl', 'numpy', 'cryptography', 'pip', 'kopf', 'aiohttp', 'gpuobj_operator', 'gpuobj_dev')}))"
    )
    out = podman_run(operator_image, "-c", probe, entrypoint="python")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        '{"torch": false, "nixl": false, "numpy": false, "cryptography": true, "pip": false, '
        '"kopf": false, "aiohttp": true, "gpuobj_operator": true, "gpuobj_dev": false}'
    )


def test_pause_image_is_built_locally(operator_image: str) -> None:
    assert images.image_exists(images.PAUSE_IMAGE)
    config = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Config.Entrypoint}} {{.Config.User}}", images.PAUSE_IMAGE],
        env=images.container_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert config.stdout.strip() == "[/pause] 65535:65535"
