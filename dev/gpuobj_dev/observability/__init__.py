"""Dashboards, alert rules and plots built from gpuobj_contract.metric_names: the observability contract as code.

Generated artefacts (deploy/grafana, deploy/prometheus) are written by
``python -m gpuobj_dev.observability.dashboard --write`` and
``python -m gpuobj_dev.observability.rules --write``; ``--check`` fails when a committed
file no longer matches the code, so the JSON and YAML never drift from the names.
"""
