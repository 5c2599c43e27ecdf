"""Engine plugins: the engines' own Engram layers take their tables from engramd.

Each engine module (`vllm`) is a thin adapter loaded by the engine's own
plugin mechanism; `common` holds what every engine does the same way. No
engine is imported here: an engine module imports its engine only when the
engine loads it.
"""
