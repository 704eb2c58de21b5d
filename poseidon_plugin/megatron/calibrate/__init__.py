"""Live calibration of the running job and the per-op timeline recorder."""
