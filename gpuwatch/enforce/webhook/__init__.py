"""The Alertmanager webhook: the HTTP receiver (receiver) and the pure step from a firing
alert to an enforcement request (requests)."""
