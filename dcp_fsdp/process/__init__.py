"""Process life and death: parent-death signals, owned temporary directories, peers that
ended first, signals that end a rank, the op watchdog and one-line causes of failures."""
