"""The layer profiler, per-op overheads and p2p call costs, gathering profiles, `poseidon profile`."""
