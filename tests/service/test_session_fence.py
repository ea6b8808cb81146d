"""Whose state a stored record is (pure logic): the judgment every copy of a session makes of what it
finds in Redis, by tags a lost write can never repeat."""
import pytest

from app.session_fence import BEHIND, DELETED, DIVERGED, MINE, MISSING, MOVED_ON, judge, lost_saves
from app.session_store import Stored


@pytest.mark.parametrize("tag, lineage, stored, verdict", [
    ("t2", ["t1", "t2"], Stored("t2", ("t1", "t2")), MINE),
    (None, [], Stored(None), MINE),  # a copy never saved meets no record: the first save makes it
    ("t2", ["t1", "t2"], Stored("t3", ("t1", "t2", "t3")), MOVED_ON),  # another replica went on from mine
    ("t2", ["t1", "t2"], Stored("t1", ("t1",)), BEHIND),  # the store lost my last save; nobody went on
    ("t2", ["t1", "t2"], Stored("t3", ("t1", "t3")), DIVERGED),  # lost, and another replica went on from t1
    ("t2", ["t1", "t2"], Stored(None), MISSING),  # the store lost the record (or it expired)
    ("t2", ["t1", "t2"], Stored("x", (), deleted=True), DELETED),
    ("t2", ["t1", "t2"], Stored("z9", ("z8", "z9")), MOVED_ON),  # nothing shared: too far on to tell
])
def test_judge(tag, lineage, stored, verdict):
    assert judge(tag, lineage, stored) == verdict


def test_an_integer_fence_would_take_a_rolled_back_store_for_the_copy_s_own_state():
    """Why tags: after a loss, the record another replica saved on the older state can carry the very
    number this copy holds, and a copy counted stale only when the stored number is larger saves over it."""
    mine = ["t1", "t2"]  # saved v1, v2; the store lost v2, another replica saved its own "v2" on v1
    assert judge("t2", mine, Stored("t2b", ("t1", "t2b"))) == DIVERGED


def test_lost_saves_count_what_follows_the_last_common_tag():
    assert lost_saves(["t0", "t1", "t2", "t3"], Stored("t9", ("t0", "t1", "t9"))) == 2
    assert lost_saves(["t1", "t2"], Stored("t1", ("t1",))) == 1
