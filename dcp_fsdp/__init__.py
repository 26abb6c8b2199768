"""dcp_fsdp: a checkpoint I/O benchmark for PyTorch Distributed Checkpoint on S3."""

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("dcp_fsdp")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
