"""The dev node's generated configuration (gpuobj_dev.node), checked without starting anything.

tests/e2e/node runs the real node; these pin the decisions that keep it contained: pods route only the
bridge and the service IP, no masquerade, iptables rules only in our own chains, no image GC (images
cannot be pulled back), cgroup v1 allowed, everything under the gpuobj-node cgroup.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from gpuobj_dev import images, node


def test_kubelet_config_allows_cgroup_v1_and_never_collects_images() -> None:
    cfg = node.kubelet_config(
        sock=Path("/run/x.sock"), port=1, healthz_port=2, ca=Path("/ca.crt"), pod_logs=Path("/logs")
    )
    assert cfg["failCgroupV1"] is False
    assert cfg["cgroupRoot"] == "/gpuobj-node"
    assert cfg["imageGCHighThresholdPercent"] == 100
    assert cfg["authentication"]["anonymous"] == {"enabled": False}
    assert (cfg["address"], cfg["healthzBindAddress"]) == (node.GATEWAY, "127.0.0.1")


def test_containerd_config_is_valid_toml_with_the_local_pause_image() -> None:
    text = node.containerd_config(Path("/r"), Path("/s"), Path("/s/c.sock"), Path("/cni"))
    cfg = tomllib.loads(text)
    assert cfg["version"] == 3
    assert cfg["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == images.PAUSE_IMAGE
    runtime = cfg["plugins"]["io.containerd.cri.v1.runtime"]
    assert runtime["restrict_oom_score_adj"] is True
    assert runtime["netns_mounts_under_state_dir"] is True
    assert runtime["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False
    assert runtime["cni"]["conf_dir"] == "/cni"


def test_pods_route_only_the_bridge_and_the_service_ip() -> None:
    (bridge,) = node.cni_conflist(Path("/ipam"))["plugins"]
    assert bridge["bridge"] == node.BRIDGE
    assert bridge["ipMasq"] is False
    assert bridge["ipam"]["routes"] == [{"dst": f"{node.SERVICE_IP}/32"}]


def test_iptables_rules_live_in_our_chains_and_match_the_bridge() -> None:
    rules = node.iptables_rules(6443)
    assert {r[1] for _, r in rules} == {node.NAT_CHAIN, node.FWD_CHAIN}
    assert all(node.BRIDGE in r for _, r in rules)
    (dnat,) = [r for t, r in rules if t == "nat"]
    assert dnat[-1] == "127.0.0.1:6443"
