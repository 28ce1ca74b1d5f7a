"""Metrics, traces and logs: the extension's own, the example app's ``/metrics`` and OTLP switch,
and the figures added up across gunicorn workers."""
