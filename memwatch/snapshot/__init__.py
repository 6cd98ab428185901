"""PyTorch memory snapshots (``torch.cuda.memory._dump_snapshot``) read safely and joined to a run as events."""

from memwatch.snapshot.importer import ImportResult, import_snapshot, snapshot_events
from memwatch.snapshot.reader import MemorySnapshot
from memwatch.snapshot.untrusted import read_snapshot

__all__ = ["ImportResult", "MemorySnapshot", "import_snapshot", "read_snapshot", "snapshot_events"]
