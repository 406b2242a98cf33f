"""Pointer-level launch builders: each family's LaunchSpecs from device addresses of any arena."""
