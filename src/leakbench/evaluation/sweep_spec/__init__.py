"""The sweep spec: its model (what a YAML file may say), reading it, checking every name, size and pairing, and
the presets shipped with leakbench."""
