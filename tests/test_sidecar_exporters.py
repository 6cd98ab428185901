"""What a sidecar started with exporters feeds them (:meth:`memwatch.sidecar.daemon.Sidecar.start`): every ring's
records, each rank's records lost in its ring and the rings refused by reason, as ``/metrics`` renders them. A real
ring lapped by its writer, a refused ring, a real store; the counts follow from the ring's 64 slots."""

from __future__ import annotations

import os
from pathlib import Path

from memwatch.export.config import ExportConfig
from memwatch.export.pipeline import Exporters
from memwatch.export.prometheus import render
from memwatch.sidecar.daemon import Sidecar
from memwatch_engine.ring import RingWriter


def test_the_exporters_are_fed_the_records_read_the_records_lost_and_the_rings_refused(
        runtime_dir: Path, db_path: Path, tmp_path: Path) -> None:
    exporters = Exporters(ExportConfig())
    sidecar = Sidecar(runtime_dir, db_path, state_dir=tmp_path / "state", exporters=exporters)
    sidecar.start()
    ring = RingWriter(runtime_dir / "lap-r1.ring", run_id="lap", rank=1, world_size=2, meta={"engine": "raw"},
                      capacity=64)
    try:
        for step in range(100):  # into 64 slots: a lapped reader keeps an eighth (8) clear, so 56 read, 44 lost
            ring.write_sample(step, 1000 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
        os.close(os.open(runtime_dir / "open-r0.ring", os.O_CREAT | os.O_WRONLY, 0o600))
        os.chmod(runtime_dir / "open-r0.ring", 0o644)
        sidecar.collector.scan()
        assert sidecar.collector.poll() == 56
        lines = render(exporters.state).splitlines()
        labels = f'run_id="lap",rank="1",engine="raw",model="unknown",host="unknown",pid="{os.getpid()}"'
        assert f"memwatch_samples_total{{{labels}}} 56" in lines
        assert f"memwatch_ring_records_lost_total{{{labels}}} 44" in lines
        assert [line for line in lines if line.startswith("memwatch_rings_refused{")] == [
            'memwatch_rings_refused{reason="untrusted_uid"} 0', 'memwatch_rings_refused{reason="mode"} 1',
            'memwatch_rings_refused{reason="not_regular"} 0', 'memwatch_rings_refused{reason="unreadable"} 0',
            'memwatch_rings_refused{reason="invalid"} 0']
    finally:
        sidecar.close()
        ring.close()
    assert sidecar.exporters is None  # closed with the sidecar
