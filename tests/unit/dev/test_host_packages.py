"""The image build installs every host command it runs, whatever ran before it.

Why: on a fresh machine the images tests ran before the dev node's setup, and `podman import` failed
with 'default OCI runtime "runc" not found': the image build had relied on the node to install runc.
"""

from __future__ import annotations

from gpuobj_dev import images, node


def test_the_image_build_checks_for_and_installs_an_oci_runtime_of_its_own() -> None:
    assert "runc" in images.HOST_PACKAGES
    assert "/usr/sbin/runc" in images.HOST_COMMANDS


def test_every_command_the_image_build_checks_for_comes_from_a_package_it_installs() -> None:
    named = {c.rsplit("/", 1)[-1] for c in images.HOST_COMMANDS}
    assert named <= set(images.HOST_PACKAGES)


def test_the_node_installs_the_runtime_the_image_build_uses_too() -> None:
    """Both install runc: either may run first."""
    assert "runc" in node.HOST_PACKAGES
