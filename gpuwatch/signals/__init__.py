"""Node facts for schedulers: GPU health and Xids (health, kmsg), topology, network (the only
`import pyroute2`), and the Node Feature Discovery feature file (nfd). Each module is a
source or a pure function over the Snapshot; `collector.SignalCollector` runs them once per
sample interval for the sampler."""
