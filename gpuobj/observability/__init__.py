"""Dashboards, alert rules and plots built from gpuobj.metric_names: the observability contract as code.

Generated artefacts (deploy/grafana, deploy/prometheus) are written by
``python -m gpuobj.observability.dashboard --write`` and
``python -m gpuobj.observability.rules --write``; ``--check`` fails when a committed
file no longer matches the code, so the JSON and YAML never drift from the names.
"""
