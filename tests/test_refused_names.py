"""The refused ring names the collector remembers: bounded, oldest forgotten first, counted by reason now."""

from __future__ import annotations

import threading

import pytest

from memwatch.sidecar.refused_names import MAX_REFUSED, REASONS, RefusedNames

NONE = dict.fromkeys(REASONS, 0)


def test_names_are_counted_by_reason_with_every_reason_shown() -> None:
    refused = RefusedNames()
    assert refused.counts() == NONE and len(refused) == 0 and refused.generation == 0
    refused.add("a.ring", "mode")
    refused.add("b.ring", "mode")
    refused.add("c.ring", "untrusted_uid")
    refused.add("stored.ring")  # a stored ring that could not be removed: remembered, not counted
    assert refused.counts() == {**NONE, "mode": 2, "untrusted_uid": 1}
    assert len(refused) == 4 and refused.generation == 4
    assert "stored.ring" in refused and "a.ring" in refused and "d.ring" not in refused
    assert refused.names(frozenset({"mode"})) == ["a.ring", "b.ring"]
    assert refused.names(frozenset({"mode", "untrusted_uid"})) == ["a.ring", "b.ring", "c.ring"]
    assert refused.names(frozenset({"invalid"})) == []


def test_an_unknown_reason_is_refused_and_nothing_is_remembered() -> None:
    refused = RefusedNames()
    with pytest.raises(ValueError, match=r"^unknown refusal reason 'chosen by someone'$"):
        refused.add("a.ring", "chosen by someone")
    assert len(refused) == 0 and refused.generation == 0 and refused.counts() == NONE


def test_a_name_refused_again_is_counted_once_under_its_newest_reason() -> None:
    refused = RefusedNames(limit=2)
    refused.add("a.ring", "mode")
    refused.add("b.ring", "invalid")
    refused.add("a.ring", "unreadable")  # now the newest: b.ring is the oldest
    assert refused.counts() == {**NONE, "invalid": 1, "unreadable": 1}
    assert len(refused) == 2 and refused.generation == 3
    refused.add("c.ring", "mode")
    assert "b.ring" not in refused and "a.ring" in refused
    assert refused.counts() == {**NONE, "unreadable": 1, "mode": 1}
    refused.add("c.ring")  # the same name, now without a reason: no longer counted
    assert refused.counts() == {**NONE, "unreadable": 1}


def test_past_the_limit_the_oldest_are_forgotten_and_uncounted() -> None:
    refused = RefusedNames(limit=3)
    for i, reason in enumerate(("mode", "mode", None, "invalid")):
        refused.add(f"{i}.ring", reason)
    assert len(refused) == 3 and "0.ring" not in refused and "3.ring" in refused
    assert refused.counts() == {**NONE, "mode": 1, "invalid": 1}
    refused.add("4.ring", "invalid")  # forgets 1.ring (mode)
    refused.add("5.ring", "invalid")  # forgets 2.ring (not counted)
    assert refused.counts() == {**NONE, "invalid": 3}
    assert refused.names(frozenset(REASONS)) == ["3.ring", "4.ring", "5.ring"]


def test_the_default_limit_keeps_exactly_max_refused_names() -> None:
    refused = RefusedNames()
    for i in range(MAX_REFUSED):
        refused.add(f"{i}.ring", "mode")
    assert len(refused) == 4096 and "0.ring" in refused
    refused.add("one more.ring", "mode")
    assert len(refused) == 4096 and "0.ring" not in refused and "1.ring" in refused
    assert refused.counts()["mode"] == 4096


def test_a_discarded_name_is_forgotten_and_uncounted() -> None:
    refused = RefusedNames()
    refused.add("a.ring", "not_regular")
    refused.add("b.ring", "not_regular")
    refused.add("c.ring")
    refused.discard("a.ring")
    refused.discard("c.ring")
    refused.discard("never.ring")
    assert "a.ring" not in refused and len(refused) == 1
    assert refused.counts() == {**NONE, "not_regular": 1}
    assert refused.generation == 3  # only adds move it


def test_a_complete_listing_forgets_counted_names_it_no_longer_shows_added_up_to_its_start() -> None:
    refused = RefusedNames()
    refused.add("gone.ring", "mode")        # generation 1
    refused.add("stays.ring", "mode")       # 2
    refused.add("uncounted.ring")           # 3: never forgotten by a listing
    refused.add("at start.ring", "invalid")  # 4: added as the listing began, and not in it
    before = refused.generation
    refused.add("after.ring", "invalid")    # 5: added while the listing ran
    refused.forget_unlisted({"stays.ring"}, before)
    assert refused.names(frozenset(REASONS)) == ["stays.ring", "after.ring"]
    assert "uncounted.ring" in refused and len(refused) == 3
    assert refused.counts() == {**NONE, "mode": 1, "invalid": 1}


def test_adds_from_many_threads_are_all_counted() -> None:
    refused = RefusedNames(limit=10**6)

    def add(thread: int) -> None:
        for i in range(2000):
            refused.add(f"{thread}-{i}.ring", "mode")

    threads = [threading.Thread(target=add, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(refused) == 8000 and refused.generation == 8000
    assert refused.counts() == {**NONE, "mode": 8000}
