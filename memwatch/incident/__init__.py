"""Incident bundles: a run's evidence in one checked file that outlives the node, readable by every command."""
