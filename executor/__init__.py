"""Runtime, step plan, reference step, Executor (bind/step) and the `hopdec` CLI."""
