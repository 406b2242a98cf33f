"""Model config, weight formats, checkpoints and TP sharding (numpy only; never touches the GPU)."""
