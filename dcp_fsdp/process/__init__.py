"""Process life and death (parent-death signals, owned temp directories, peers, ending signals), the
threads that watch a running operation (watchdog, heartbeat, wire meter) and one-line failure causes."""
