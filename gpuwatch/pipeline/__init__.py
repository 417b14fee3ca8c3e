"""The node pipeline: one sample of the node per interval.

The sampler reads the sources (gpu/, probes/ counters, containers/, signals/), attributes GPU
memory and kernel time to containers (attribution, probe_join) and publishes a Snapshot that
the consumers (exporter, enforcer, top) read. It imports sources, never consumers.
"""
