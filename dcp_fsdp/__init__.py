"""dcp_fsdp: a checkpoint I/O benchmark for PyTorch Distributed Checkpoint on S3."""


def __getattr__(name: str) -> str:
    # Looked up when asked for, not at import: importlib.metadata's ~20 ms would be a window in
    # which a Ctrl-C prints a traceback before cli.main can answer it.
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dcp_fsdp")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0+unknown"
