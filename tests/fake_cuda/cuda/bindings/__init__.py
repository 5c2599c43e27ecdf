"""A stand-in for cuda-bindings: only the driver module (driver.py)."""
