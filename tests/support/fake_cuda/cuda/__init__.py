"""A stand-in for NVIDIA's `cuda` package where no GPU exists (see bindings/driver.py)."""
