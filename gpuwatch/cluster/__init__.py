"""Reading every node's agent metrics back from Prometheus: the cluster view shared by
`gpuwatch extender` and `gpuwatch top --prometheus`. No state of its own beyond a short
cache: Prometheus is the store."""
