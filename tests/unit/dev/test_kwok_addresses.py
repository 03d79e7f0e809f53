"""The scale fleet's pod addresses: chosen by the fleet, unique, never the nodes' IP (dev/gpuobj_dev/scale/kwok.py).

kwok v0.8's own IP pool can give two pods started together the same first address; the fleet's pods
carry their address in an annotation that kwok's stage reports as status.podIP instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuobj_dev.scale.kwok import POD_IP_ANNOTATION, POD_RUNNING_TEMPLATE, Kwok, KwokError


def kwok(cidr: str) -> Kwok:
    return Kwok(Path("/nonexistent/kubeconfig"), Path("/nonexistent/logs"), run_id="r", cidrs=(cidr,))


def test_every_pod_gets_its_own_address_and_none_is_the_nodes() -> None:
    k = kwok("10.219.0.0/24")
    addresses = [k.pod_ip(n) for n in range(253)]
    assert len(set(addresses)) == 253
    assert "10.219.0.1" not in addresses  # the nodes' --node-ip
    assert addresses[0] == "10.219.0.2" and addresses[-1] == "10.219.0.254"


def test_a_cidr_out_of_addresses_is_refused_by_name() -> None:
    with pytest.raises(KwokError, match=r"10\.219\.0\.0/24 has no address left"):
        kwok("10.219.0.0/24").pod_ip(253)


def test_the_running_stage_reports_the_annotated_address_not_kwoks_pool() -> None:
    assert f'index .metadata.annotations "{POD_IP_ANNOTATION}"' in POD_RUNNING_TEMPLATE
    assert "PodIP" not in POD_RUNNING_TEMPLATE
