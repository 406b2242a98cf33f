"""Stage modules: the plan's roles as launches on one rank's arena (executor/wiring.py)."""
