"""Policing: the enforcer that turns the policy's decisions into actions on cgroups.

* enforcer: the coordinator, called once per snapshot (EnforcerConfig: how it runs;
  EnforcerHooks: what it is plugged into);
* policy_reload: the running policy and its file, read and checked off the main loop;
* actions/: alert, throttle, pause, checkpoint, kill -- one module per action; control: the
  freeze/thaw control they share; duty_cycle: the freeze/thaw duty cycle a throttle runs;
  cgroup_ops: cgroup file operations;
* freeze/: freeze/thaw bookkeeping that survives an agent crash (state journal, cgroup
  markers, recovery at start);
* kernel_limits: the one protocol of the in-kernel limit map and of the device gate (the
  probes implement them), with the null stand-ins; kernel_push: keeps the map in step;
  inkernel_guard: the probe-vs-NVML safety net in front of it;
* device_sharing: the sharing annotations and device limits carried out; sharing_hooks: the
  node container listing and the ledger of what was done;
* enforcement_view: why each container runs as it does (top's STATE/SHARE);
* webhook/: the Alertmanager receiver, the pure step from a firing alert to a request, and
  the enforcer's intake of it (dedup, rate limit);
* audit, metrics, probe_events: the audit log, the Prometheus families, probe events in.
"""
