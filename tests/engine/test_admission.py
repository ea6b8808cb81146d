"""The admission queue on its own: turns wait in arrival order for room that turns in flight hold,
and are refused when waiting cannot help or lasts too long (the engine's use: test_capacity_budget)."""
import asyncio

from app.engine.admission import AdmissionQueue


class Room:
    """Free bytes that turns take and give back."""

    def __init__(self, free: int):
        self.free = free
        self.order: list[str] = []

    def taker(self, name: str, need: int):
        def take() -> bool:
            if need > self.free:
                return False
            self.free -= need
            self.order.append(name)
            return True
        return take


async def test_a_turn_that_fits_is_admitted_at_once_and_one_that_cannot_wait_is_refused_at_once():
    queue, room = AdmissionQueue(), Room(10)
    assert await queue.admit(room.taker("a", 6), lambda: True, wait_s=5)
    t0 = asyncio.get_running_loop().time()
    assert not await queue.admit(room.taker("b", 6), lambda: False, wait_s=5)  # nothing in flight to wait for
    assert not await queue.admit(room.taker("c", 6), lambda: True, wait_s=0)  # waiting turned off
    assert asyncio.get_running_loop().time() - t0 < 0.1
    assert room.order == ["a"] and len(queue) == 0


async def test_waiting_turns_are_admitted_in_arrival_order_as_room_is_released():
    queue, room = AdmissionQueue(), Room(4)
    big = asyncio.create_task(queue.admit(room.taker("big", 8), lambda: True, wait_s=10))
    await asyncio.sleep(0.01)
    small = asyncio.create_task(queue.admit(room.taker("small", 3), lambda: True, wait_s=10))
    await asyncio.sleep(0.01)
    # The small turn would fit now, but the big one arrived first and waits at the head.
    assert room.order == [] and len(queue) == 2
    room.free += 4  # a turn in flight ends
    queue.changed()
    assert await asyncio.wait_for(big, 1)
    assert not small.done()
    room.free += 3
    queue.changed()
    assert await asyncio.wait_for(small, 1)
    assert room.order == ["big", "small"] and len(queue) == 0


async def test_a_turn_waits_at_most_its_time_and_the_next_in_line_then_tries():
    queue, room = AdmissionQueue(), Room(2)
    t0 = asyncio.get_running_loop().time()
    first = asyncio.create_task(queue.admit(room.taker("first", 5), lambda: True, wait_s=0.2))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(queue.admit(room.taker("second", 2), lambda: True, wait_s=5))
    assert not await first
    assert 0.2 <= asyncio.get_running_loop().time() - t0 < 1.0
    assert await asyncio.wait_for(second, 1)  # woken when the one ahead of it gave up
    assert room.order == ["second"]


async def test_a_waiting_turn_is_refused_once_nothing_it_could_wait_for_is_in_flight():
    queue, room = AdmissionQueue(), Room(1)
    in_flight = [True]
    waiting = asyncio.create_task(queue.admit(room.taker("a", 3), lambda: in_flight[0], wait_s=10))
    await asyncio.sleep(0.01)
    in_flight[0] = False  # the turn in flight ended and released too little
    queue.changed()
    assert not await asyncio.wait_for(waiting, 1)
    assert len(queue) == 0
