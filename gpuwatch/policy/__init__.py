"""The policy: pure rules and decisions (no I/O beyond the loader's one bounded file read).

loader/jsonschema parse and validate a policy file into rules (the immutable model);
match, evaluate, ladder, arbitration, sharing, elastic, deadlock, probe_trust and placement
decide; decisions and usage are the values they hand the enforcer.
"""
