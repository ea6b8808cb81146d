"""The bookkeeping of which page copies Redis holds and which generations name them (pure logic)."""
from tiers.redis_copies import RedisCopies


def test_a_named_copy_outlives_its_page_until_a_generation_commits_without_it():
    c = RedisCopies()
    c.add("s", ["a", "b", "c"])
    c.hold("s", "g1", 2, ["a", "b"])
    c.commit("s", "g1")
    assert c.free("s", ["a", "c"]) == ["c"]  # c: no generation names it; a: g1 does, it waits
    assert not c.holds("s", "a") and c.kept("s") == {"a", "b"}
    c.hold("s", "g2", 2, ["b"])
    done = c.commit("s", "g2")
    assert done.gens == {"g1": 2} and done.pages == ["a"] and not done.sweep
    assert c.kept("s") == {"b"} and c.gens("s") == {"g2": 2}


def test_an_abandoned_generation_releases_only_what_it_alone_named():
    c = RedisCopies()
    c.add("s", ["a", "b"])
    c.hold("s", "g1", 1, ["a"])
    c.commit("s", "g1")
    c.hold("s", "g2", 1, ["a", "b"])
    assert c.free("s", ["a", "b"]) == []  # both named (g1, g2): they wait
    done = c.abandon("s", "g2")
    assert done.gens == {"g2": 1} and done.pages == ["b"]  # a is still g1's
    assert c.gens("s") == {"g1": 1}


def test_a_session_leaving_keeps_what_its_record_names_and_a_move_sweeps_once():
    c = RedisCopies()
    c.adopt("s", "g1", 1, ["a", "b"])
    c.add("s", ["x"])  # spilled since: no record names it
    left = c.leave("s")
    assert left.pages == ["x"] and left.gens == {} and c.sessions() == 0
    c.adopt("s", "g1", 1, ["a"])
    c.hold("s", "g2", 1, ["a"])
    assert c.commit("s", "g2").sweep and not c.commit("s", "g2").sweep
    assert c.written_after_free("s", ["a", "z"]) == ["z"] and c.kept("s") == {"a"}
    c.forget("s")
    assert c.written_after_free("s", ["a"]) == ["a"]


def test_a_session_leaving_drops_the_generations_no_record_was_known_to_name():
    c = RedisCopies()
    c.adopt("s", "g1", 1, ["a", "b"])
    c.add("s", ["c"])
    c.hold("s", "park", 1, ["a", "c"])  # a park's generation: written, never committed
    left = c.leave("s")
    assert left.gens == {"park": 1} and left.pages == ["c"]  # g1 and its pages stay for its record
    c.hold("t", "g", 1, ["p"])  # never committed at all: nothing of it stays
    c.add("t", ["p"])
    left = c.leave("t")
    assert left.gens == {"g": 1} and left.pages == ["p"]


def test_a_record_without_kv_supersedes_the_generations_up_to_the_one_named_before():
    c = RedisCopies()
    c.add("s", ["a", "b", "c"])
    c.hold("s", "g0", 1, ["b"])
    c.hold("s", "g1", 1, ["a", "b"])
    assert c.commit("s", "g1").sweep  # the first commit in a process clears what earlier holders left
    c.hold("s", "g2", 1, ["a", "c"])  # written since (a park's): no record has named it yet
    assert c.free("s", ["a", "b"]) == []  # named by g1 or g2: they wait
    done = c.commit("s", None)  # a record naming no KV committed
    assert done.gens == {"g1": 1} and done.pages == ["b"] and not done.sweep
    assert c.gens("s") == {"g2": 1} and c.kept("s") == {"a", "c"}
    assert c.commit("s", None).gens == {}  # nothing named before: nothing more to supersede
    assert c.commit("s", "g9").gens == {}  # a generation not known here commits nothing
