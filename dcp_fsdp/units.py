"""The byte units of every figure, defined once (docs/metrics.md: MiB = 2^20 bytes)."""

MIB = 2**20
GIB = 2**30
