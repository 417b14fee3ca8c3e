"""Prometheus exporter: a Collector over the latest Snapshot, and its HTTP server."""
