"""CPU emulation of device types and host contention."""
