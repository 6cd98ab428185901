"""Names from a ring reach ``/metrics`` as plain text: no control character, no bidi override, always UTF-8.

A writer chooses its model, host, GPU and pod names. Written raw into a label value, an ESC or an OSC 52
sequence reaches whoever reads the series in a terminal, and a lone surrogate (a resource attribute from an
environment that is not UTF-8) cannot be encoded at all, so the whole scrape fails. Each exposition here is read back by
prometheus_client's text parser and checked by ``promtool check metrics``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from memwatch.export.prometheus import render
from memwatch.export.state import ExportState
from memwatch_engine.ring import RingWriter

from prometheus_server import binary
from stored_runs import store_rings

OSC52 = "\x1b]52;c;cm0gLXJmIH4K\x07"  # "set the clipboard", as a terminal reads it
HOSTILE = {
    "model": f"qwen{OSC52}\r\n\x1b[2J",
    "hostname": "node\x00\x07\x7f\x85\x9b7",
    "gpu_name": "NVIDIA\u202eH100\udc80",
    "engine": 'nano"vllm\\x1b',
    "k8s_pod_name": "pod\tx\x0b\x0c",
}
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _values(labels: list[dict[str, str]], name: str) -> set[str]:
    return {label[name] for label in labels if name in label}


def _exposition(runtime_dir: Path, db_path: Path) -> str:
    ring = RingWriter(runtime_dir / "hostile-r0.ring", run_id="hostile", meta=HOSTILE, capacity=256)
    ring.write_sample(1, 10**18, 5, 2, 0, 100, 200, 300, 400, 500, 6, 7, 8, 9)
    ring.close()
    state = ExportState(linger=3600)
    store_rings(runtime_dir, db_path, observers=[state])
    return render(state, {"service.name": "memwatch\x1b]0;owned\x07\udcff"})  # from an environment not UTF-8


def test_hostile_names_are_plain_text_in_every_label_and_the_scrape_parses(runtime_dir: Path, db_path: Path) -> None:
    text = _exposition(runtime_dir, db_path)
    body = text.encode("utf-8")  # a lone surrogate made this raise: every scrape failed
    assert not UNSAFE.search(text.replace("\n", "")), "an unsafe character reached the exposition"
    labels = [sample.labels for family in text_string_to_metric_families(text) for sample in family.samples]
    models = _values(labels, "model")
    assert models == {"qwen\\x1b]52;c;cm0gLXJmIH4K\\x07\\x0d\\x0a\\x1b[2J"}
    assert _values(labels, "host") == {"node\\x00\\x07\\x7f\\x85\\x9b7"}
    assert _values(labels, "hw_name") == {"NVIDIA\\u202eH100\ufffd"}  # ring: UTF-8
    assert _values(labels, "engine") == {'nano"vllm\\x1b'}  # quote and \ kept
    assert _values(labels, "service_name") == {"memwatch\\x1b]0;owned\\x07\\udcff"}
    assert all(not UNSAFE.search(value) for label in labels for value in label.values())
    checked = subprocess.run([binary("promtool"), "check", "metrics"], input=body, capture_output=True, timeout=60)
    report = checked.stderr.decode() + checked.stdout.decode()
    assert checked.returncode in (0, 3) and "error" not in report, report  # 3: style hints about names, parsed


def test_a_plain_name_is_unchanged(runtime_dir: Path, db_path: Path) -> None:
    ring = RingWriter(runtime_dir / "plain-r0.ring", run_id="plain", meta={"model": "Qwen/Qwen3-0.6B é 模型"},
                      capacity=256)
    ring.write_sample(1, 10**18, 5, 2, 0, 100, 200, 300, 400, 500, 6, 7, 8, 9)
    ring.close()
    state = ExportState(linger=3600)
    store_rings(runtime_dir, db_path, observers=[state])
    text = render(state)
    labels = [sample.labels for family in text_string_to_metric_families(text) for sample in family.samples]
    assert _values(labels, "model") == {"Qwen/Qwen3-0.6B é 模型"}
