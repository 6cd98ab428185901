"""``python -m memwatch`` — the same as the ``memwatch`` command (used to spawn the sidecar)."""

from memwatch.cli import main

main(prog_name="memwatch")
