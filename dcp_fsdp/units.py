"""Every figure's byte units (docs/metrics.md: MiB = 2^20 bytes) and S3's request limits, defined once."""

MIB = 2**20
GIB = 2**30
PUT_LIMIT_PER_S = 3500  # at least, per partitioned prefix (S3 docs: performance guidelines)
GET_LIMIT_PER_S = 5500
