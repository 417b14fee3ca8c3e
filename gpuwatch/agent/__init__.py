"""The composition root: the only package that wires sources, pipeline and consumers together.

daemon (AgentConfig, run_agent; `python -m gpuwatch.agent.daemon`), enforcer_factory (the
enforcer with the probes' limit map and the resolver plugged in), idle (an agent on a node
without NVIDIA devices) and nodelock (one agent per node). Everything else receives its
collaborators; tests/unit/test_layering.py holds the code to that.
"""
