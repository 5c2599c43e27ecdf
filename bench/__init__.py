"""The benchmark behind every performance claim: `make bench`, or `python -m bench --help`."""
