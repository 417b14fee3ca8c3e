"""`gpuwatch extender`: kube-scheduler's extender webhook (filter, prioritize) placing GPU
pods by what the nodes really have, read from Prometheus (gpuwatch.cluster). Stateless
apart from a few seconds of promised memory."""
