"""Stage 0: is this machine ready? The environment report (`report`) and the known failures it explains."""
