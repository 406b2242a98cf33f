"""NCCL communicator and custom IPC all-reduce (no model knowledge)."""
