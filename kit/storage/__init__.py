"""Storage that is complete or absent, here or on OBS: atomic writes, locks, partial folders, hashes."""
