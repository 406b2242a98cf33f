"""Stage modules: each group's launch builders, buffers and weights for the wired decode step."""
