"""Policing: the enforcer that turns the policy's decisions into actions on cgroups.

* enforcer: the coordinator, called once per snapshot;
* actions/: alert, throttle, pause, checkpoint, kill -- one module per action;
* freeze/: freeze/thaw bookkeeping that survives an agent crash (state journal, cgroup
  markers, recovery at start);
* duty_cycle: the freeze/thaw duty cycle a throttle runs; cgroup_ops: cgroup file operations;
* kernel_limits, limitmap: the in-kernel limits (one protocol, implemented by the probes);
* inkernel_guard: the probe-vs-NVML safety net in front of those limits;
* webhook/: the Alertmanager receiver and how a firing alert becomes a request;
* audit, metrics, policy_reload, sharing_hooks, control, probe_events: what they say.
"""
