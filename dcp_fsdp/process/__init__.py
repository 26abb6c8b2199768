"""Process life and death: parent-death signals, owned temporary directories, peers that
ended first, signals that end a rank, the threads that watch a running operation (the
watchdog, the progress heartbeat) and one-line causes of failures."""
