"""dcp_fsdp: a checkpoint I/O benchmark for PyTorch Distributed Checkpoint on S3."""


def __getattr__(name: str) -> str:
    # __version__ is looked up when asked for (`dcp-fsdp --version`), not when any module of
    # the package is imported: importlib.metadata costs ~20 ms, a window in which a Ctrl-C
    # would print a traceback before the CLI can answer it (cli.main).
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dcp_fsdp")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0+unknown"
