"""The Megatron path on CPU: megatron-core runs notebook 03's shards at their TP x PP on notebook 02's data
(`python -m kit megatron preflight`); kit.train.preflight.cpu_patches holds the CPU patches, applied only in its ranks."""
