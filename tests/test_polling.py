"""The polling schedules of ``_loopside.poll``: the default backs off from
0.5 ms by doubling; FINE (a link's probes) asks for pauses from 50 us, growing
by half. Both stop at 20 ms. Checked on the schedule poll asks for (a fake
sleep): on asyncio's selector loop a pause under 1 ms sleeps about 1 ms."""

from __future__ import annotations

import itertools

import pytest


def _pauses(schedule: tuple[float, float] | None, polls: int) -> list[float]:
    import asyncio

    from aiokvcache._loopside import poll

    pauses: list[float] = []
    clock = [0.0]

    async def sleep(s: float) -> None:
        pauses.append(s)
        clock[0] += s

    left = iter(range(polls))

    def done() -> bool:
        return next(left, None) is None

    args = () if schedule is None else (schedule,)
    assert asyncio.run(poll(done, None, sleep, lambda: clock[0], *args))
    return pauses


def test_the_fine_poll_schedule_asks_for_pauses_growing_by_half() -> None:
    """A wait overshoots by up to its last pause: FINE keeps each pause within
    what was already waited, so a link's short probe waits stay short."""
    from aiokvcache._loopside import FINE

    fine = _pauses(FINE, 40)
    assert fine[0] == pytest.approx(50e-6)
    assert all(b <= a * 1.5 + 1e-12 for a, b in itertools.pairwise(fine))
    assert max(fine) == pytest.approx(0.02)
    # Each pause (what a wait can be overshot by) is at most the time already
    # waited past the first two, and tends to half of it.
    waited = 0.0
    for i, p in enumerate(fine):
        if i >= 2 and p < 0.02:
            assert p <= waited, (i, p, waited)
        waited += p
    default = _pauses(None, 10)
    assert default[:3] == pytest.approx([0.0005, 0.001, 0.002])
