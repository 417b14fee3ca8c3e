"""Freeze and thaw that survive a crash: the state journal, the marker on each frozen cgroup
and the recovery that thaws what a dead agent left frozen."""
