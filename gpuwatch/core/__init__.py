"""Shared ground every layer may import, and which imports no other gpuwatch package.

The data model (model), typed errors (errors), the snapshot's JSON document (snapshot_doc),
bounded reads of files and HTTP bodies (safeio, containerfile, jsonbounds, httpclient), the
HTTP server wrapper (httpserve), units, Prometheus label names (labels) and the parsers of
every ``gpuwatch.io/*`` pod annotation (annotations).
"""
