"""How Prometheus must scrape gpuobj: job names and the label-collision policy, in one place.

Why: the operator's ``gpuobj_leaked_bytes`` carries its own ``namespace`` and ``pod``
labels (the pod that holds the leaked bytes), and Kubernetes scraping (ServiceMonitor,
pod discovery) attaches ``namespace`` and ``pod`` target labels (the pod that was
scraped). With Prometheus' default ``honor_labels: false`` the exporter's labels would
be renamed ``exported_namespace``/``exported_pod`` and every leak would appear to sit in
the operator's pod. Policy: the operator job scrapes with ``honor_labels: true`` (the
exporter's labels win; the operator exports no other namespace/pod labels, so its other
series still get the target's); agent jobs keep the default ``false`` (agents export no
namespace/pod labels, so the target labels name the agent's pod). Dashboard and rule
queries therefore use plain ``namespace``/``pod`` and never ``exported_*``.

The test harness (gpuobj_dev.testing.prometheus) builds its config with ``scrape_config``;
the chart's ServiceMonitor must set ``honorLabels: true`` on the operator endpoint only
(see deploy/prometheus/README.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

OPERATOR_JOB = "gpuobj-operator"
AGENT_JOB = "gpuobj-agent"

# Jobs whose exporters' labels must win over target labels (see the module docstring).
HONOR_LABELS_JOBS = frozenset({OPERATOR_JOB})


def scrape_config(
    targets: Mapping[str, Sequence[str]],
    *,
    interval: str = "1s",
    target_labels: Mapping[str, Mapping[str, str]] | None = None,
    honor_labels_jobs: frozenset[str] = HONOR_LABELS_JOBS,
    https_jobs: frozenset[str] = frozenset(),
) -> dict:
    """A Prometheus config: one static job per key of ``targets`` (job -> host:port list).

    ``target_labels`` maps a target address to extra target labels (e.g. the ``namespace``
    and ``pod`` Kubernetes discovery would add), so tests can reproduce the collision.
    ``https_jobs`` scrape over HTTPS without checking the certificate, as the chart's PodMonitor
    scrapes TLS agents: /metrics is public and the scraper sends no credential.
    """
    labels = target_labels or {}
    jobs = []
    for job, addresses in targets.items():
        static = [{"targets": [a], "labels": dict(labels[a])} if a in labels else {"targets": [a]} for a in addresses]
        jobs.append(
            {
                "job_name": job,
                "honor_labels": job in honor_labels_jobs,
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "static_configs": static,
                **({"scheme": "https", "tls_config": {"insecure_skip_verify": True}} if job in https_jobs else {}),
            }
        )
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": jobs,
    }
