"""A stand-in for cuda-bindings: the driver (driver.py) and the runtime's registrations."""
