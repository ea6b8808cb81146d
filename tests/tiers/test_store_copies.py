"""The bookkeeping of which page copies the store holds and which of their groups a committed record names
(pure logic): what a holder renews, deletes on a free, and leaves behind."""
from tiers.cold.ids import PageNamer, packed_id, page_id, unpacked_id
from tiers.host.copies import StoreCopies


def test_pages_of_a_pending_group_go_when_freed_and_of_a_committed_one_with_the_next_commit():
    c = StoreCopies()
    c.add("s", ["p1/0.0", "p1/0.1", "p2/0.0"])
    assert c.pending("s") == ["p1", "p2"]
    c.write("s", "gA", {"p1": 2, "gA": 2})
    assert c.pending("s") == ["gA", "p1", "p2"]  # a generation in writing is renewed too
    c.commit("s", "gA")
    assert c.committed("s") == {"p1", "gA"} and c.pending("s") == ["p2"]
    # Freed: the pending group's copy goes now; the committed group's waits for the commit that drops it.
    assert c.free("s", ["p1/0.0", "p2/0.0"]) == ["p2/0.0"]
    assert not c.holds("s", "p1/0.0") and c.holds("s", "p1/0.1")


def test_a_commit_forgets_what_the_record_before_named_and_it_does_not():
    c = StoreCopies()
    c.adopt("s", "gA", {"p1": 1, "gA": 2}, ["p1/0.0"])
    c.add("s", ["p3/0.0"])  # a new cache's page, spilled: pending
    c.write("s", "gB", {"p3": 1, "gB": 2})
    c.commit("s", "gB")  # the commit deleted p1 and gA in Redis
    assert c.committed("s") == {"p3", "gB"} and not c.holds("s", "p1/0.0") and c.holds("s", "p3/0.0")


def test_a_record_without_kv_leaves_what_the_one_before_named_pending_for_its_holder():
    c = StoreCopies()
    c.adopt("s", "gA", {"p1": 1, "gA": 2}, ["p1/0.0"])
    c.commit("s", None)
    assert c.committed("s") == set() and c.pending("s") == ["gA", "p1"] and c.holds("s", "p1/0.0")


def test_the_next_commit_with_kv_hands_back_the_tables_a_record_without_kv_left_pending():
    c = StoreCopies()
    c.adopt("s", "gA", {"p1": 1, "gA": 2}, ["p1/0.0"])
    c.commit("s", None)
    c.write("s", "gB", {"p1": 1, "gB": 2})
    assert c.commit("s", "gB") == ["gA"]  # no record can name gA again: deleted, not renewed for ever
    assert c.pending("s") == [] and c.committed("s") == {"p1", "gB"}


def test_an_abandoned_generation_gives_back_its_tables_and_keeps_its_pages_pending():
    c = StoreCopies()
    c.add("s", ["p1/0.0"])
    c.write("s", "gA", {"p1": 1, "gA": 2})
    assert c.abandon("s", "gA") == "gA" and c.abandon("s", "gA") is None
    assert c.pending("s") == ["p1"]


def test_a_parked_generation_restored_here_stays_pending_until_a_record_names_it():
    c = StoreCopies()
    c.add("s", ["p1/0.0"])
    c.write("s", "gP", {"p1": 1, "gP": 2})  # a park's persist: no record names it yet
    c.adopt("s", "gP", {"p1": 1, "gP": 2}, ["p1/0.0"])
    assert c.committed("s") == set() and c.pending("s") == ["gP", "p1"]


def test_leaving_hands_back_what_only_this_holder_could_renew():
    c = StoreCopies()
    c.adopt("s", "gA", {"p1": 1, "gA": 2}, ["p1/0.0"])
    c.add("s", ["p2/0.0", "p3/0.0"])
    assert c.leave("s") == ["p2", "p3"] and c.sessions() == 0
    assert c.written_after_free("s", ["p9/0.0"]) == ["p9/0.0"]  # nothing names a late spill's copy


def test_a_generation_whose_commit_is_unknown_is_never_deleted_here():
    """Its commit's reply was lost: a record (this one's, or one another replica built on it) may name it."""
    c = StoreCopies()
    c.adopt("s", "gA", {"p1": 1, "gA": 2}, ["p1/0.0"])
    c.add("s", ["p2/0.0", "p2/0.1", "p3/0.0"])
    c.write("s", "gB", {"p1": 1, "p2": 2, "gB": 2})
    assert c.free("s", ["p2/0.0", "p3/0.0"]) == ["p3/0.0"]  # p2's copy stays: gB may stand
    assert c.written_after_free("s", ["p2/0.1", "p4/0.0"]) == ["p4/0.0"]
    assert c.leave("s") == ["p3"]  # gB and p2 are left to their short TTL
    c.add("t", ["p5/0.0"])
    c.write("t", "gC", {"p5": 1, "gC": 2})
    assert c.leave("t", deleted=True) == ["gC", "p5"]  # deleted: no record can ever name them


def test_distrust_is_cleared_once_trusted_again():
    c = StoreCopies()
    c.add("s", ["p1/0.0"])
    c.distrust("s")
    assert c.distrusted("s")
    c.distrust("s", False)
    assert not c.distrusted("s")


def test_page_ids_pack_and_unpack_and_a_turn_is_one_group():
    namer = PageNamer()
    first = namer.take(3, 2) + namer.take(5, 1)
    assert {i.partition("/")[0] for i in first} == {f"p{namer.epoch:07x}.0"}  # every layer's, one group
    assert [unpacked_id(3, packed_id(i)) for i in first[:2]] == first[:2]
    namer.next_batch()
    assert namer.take(3, 1)[0] == page_id(3, namer.epoch, 1, 0)
    namer.next_batch()
    namer.next_batch()  # a turn that named nothing takes no batch
    assert namer.batch == 2
    epoch = namer.epoch
    namer.renew()
    assert namer.batch == 0 and not (namer.epoch == epoch and namer.take(3, 1) == [page_id(3, epoch, 0, 0)])
