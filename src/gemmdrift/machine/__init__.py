"""The machine a measurement runs on: its backend wheels, platform facts, memory, and the environment record every
result carries."""
