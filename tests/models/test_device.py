"""`DeviceScheduler`: the order of turns across members, by class, with background's
minimum share and the one-step bound for an interactive step behind background work. Each
waiter is a real thread blocked in `acquire`; the test holds the device, lines the waiters
up, then lets the turns go one at a time and reads the order they ran in."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import slotserve as ss
from slotserve.engine.device import IDLE_AFTER_S, DeviceScheduler, DeviceSeat
from slotserve.engine.events import PRIORITIES, Priority


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the waiters never lined up"
        time.sleep(0.001)


class TurnClock:
    """A device clock on which a turn lasts what the test says: real time (so a hold for
    the classes above background lapses) plus the seconds `spend` adds."""

    def __init__(self) -> None:
        self.spent = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.spent

    def spend(self, seconds: float) -> None:
        self.spent += seconds


def run_turns(
    device: DeviceScheduler,
    waiters: list[tuple[str, Priority]],
    holder: Priority = "normal",
    costs: dict[str, float] | None = None,
    clock: TurnClock | None = None,
) -> list[str]:
    """Hold the device as ``holder``, line ``waiters`` up (in this order), release, and
    return the members in the order their turns ran; a member's turn spends
    ``costs[member]`` seconds of ``clock`` (the device's)."""
    order: list[str] = []
    device.acquire("holder", holder)
    threads = []

    def take(member: str, priority: Priority) -> None:
        with device.turn(member, priority):
            order.append(member)
            if clock is not None and costs is not None:
                clock.spend(costs[member])
            device.check_integrity()

    for count, (member, priority) in enumerate(waiters, 1):
        thread = threading.Thread(target=take, args=(member, priority))
        thread.start()
        threads.append(thread)
        wait_for(lambda: len(device.waiting) == count)  # noqa: B023 (called at once)
    device.release("holder")
    for thread in threads:
        thread.join(10)
    device.check_integrity()
    return order


def test_interactive_goes_first_whatever_arrived_before() -> None:
    device = DeviceScheduler(background_min_share=0.0)
    order = run_turns(
        device,
        [("embed", "background"), ("other", "normal"), ("chat", "interactive")],
        holder="background",
    )
    assert order == ["chat", "other", "embed"]


def test_first_come_first_served_within_a_class() -> None:
    device = DeviceScheduler()
    order = run_turns(device, [("a", "normal"), ("b", "normal"), ("c", "normal")])
    assert order == ["a", "b", "c"]


def test_background_gets_its_share_but_never_twice_ahead_of_interactive() -> None:
    # With a share of one half and turns of one length, background takes every second
    # contended turn; an interactive step never waits behind more than one background step.
    clock = TurnClock()
    device = DeviceScheduler(background_min_share=0.5, clock=clock)
    waiters: list[tuple[str, Priority]] = []
    for i in range(4):
        waiters += [(f"chat{i}", "interactive"), (f"embed{i}", "background")]
    order = run_turns(device, waiters, costs=dict.fromkeys(dict(waiters), 0.01), clock=clock)
    background = [i for i, member in enumerate(order) if member.startswith("embed")]
    assert order[:4] == ["chat0", "embed0", "chat1", "embed1"]
    assert all(b - a > 1 for a, b in itertools.pairwise(background))
    assert device.counters.max_background_ahead_of_interactive <= 1
    assert device.counters.turns_by_class["background"] == 4


def test_a_bad_share_or_class_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"background_min_share=1\.0"):
        DeviceScheduler(background_min_share=1.0)
    with pytest.raises(ValueError, match="urgent"):
        DeviceScheduler().acquire("a", "urgent")  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
# A large share with interactive steps waiting throughout: the background credit grew past
# one turn plus the share while the never-twice-ahead rule withheld its turns.
@example(waiters=["interactive", "background"] * 4, share=0.9)
@given(
    waiters=st.lists(st.sampled_from(PRIORITIES), min_size=1, max_size=8),
    share=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
)
def test_any_line_up_keeps_the_rules(waiters: list[Priority], share: float) -> None:
    device = DeviceScheduler(background_min_share=share)
    named = [(f"m{i}", priority) for i, priority in enumerate(waiters)]
    order = run_turns(device, named)
    assert sorted(order) == sorted(m for m, _ in named)  # every waiter ran once
    classes = dict(named)
    ran = [classes[m] for m in order]
    # Without background in the line-up, classes run strictly highest first.
    foreground = [c for c in ran if c != "background"]
    assert foreground == sorted(foreground, key=PRIORITIES.index)
    # An interactive step waited behind at most one background turn.
    assert device.counters.max_background_ahead_of_interactive <= 1
    if share == 0.0:
        assert ran == sorted(ran, key=PRIORITIES.index)


@settings(max_examples=25, deadline=None)
@given(
    share=st.sampled_from([0.05, 0.1, 0.25, 0.5]),
    chats=st.integers(min_value=10, max_value=30),
    background_costs=st.lists(st.integers(min_value=1, max_value=8), min_size=1, max_size=4),
)
def test_background_takes_its_share_of_device_time_not_of_turns(
    share: float, chats: int, background_costs: list[int]
) -> None:
    """Interactive turns of one length and background turns up to eight times as long, all
    waiting: while both classes wait, background's time is its share of the time, give or
    take one turn (no more: interactive pays only the share; no less: no starvation)."""
    unit = 0.01
    clock = TurnClock()
    device = DeviceScheduler(background_min_share=share, clock=clock)
    waiters: list[tuple[str, Priority]] = [(f"chat{i}", "interactive") for i in range(chats)]
    waiters += [(f"embed{i}", "background") for i in range(len(background_costs))]
    costs = dict.fromkeys((m for m, _ in waiters), unit)
    costs.update({f"embed{i}": unit * c for i, c in enumerate(background_costs)})
    order = run_turns(device, waiters, costs=costs, clock=clock)
    left = {"interactive": chats, "background": len(background_costs)}
    total = background = 0.0
    classes = dict(waiters)
    for member in order:  # the turns that ran while both classes waited
        if not all(left.values()):
            break
        total += costs[member]
        background += costs[member] if classes[member] == "background" else 0.0
        left[classes[member]] -= 1
    longest = max(costs.values())
    assert background <= share * total + longest + 1e-9
    assert background >= share * total - 2 * longest - 1e-9
    assert device.counters.max_background_ahead_of_interactive <= 1


def test_an_interactive_loop_keeps_the_device_between_its_steps() -> None:
    """An engine stepping interactive turns back to back, background waiting throughout:
    the device is held for it in the gaps between its turns, so background gets its share
    of the time, not a turn in every gap."""
    # Turns long enough that the chat thread's own gap between two of them (a loop's
    # iteration, unless the OS deschedules it for longer than a turn) stays inside the hold.
    turn_s, steps = 0.05, 20
    device = DeviceScheduler(background_min_share=0.1)
    chatting = threading.Event()
    background_turns: list[float] = []

    def background() -> None:
        while not chatting.is_set():
            time.sleep(0.001)
        while chatting.is_set():
            with device.turn("embed", "background"):
                background_turns.append(time.monotonic())
                time.sleep(turn_s)

    thread = threading.Thread(target=background)
    thread.start()
    chatting.set()
    wait_for(lambda: len(device.waiting) == 1 or bool(background_turns))
    began = time.monotonic()
    for _ in range(steps):
        with device.turn("chat", "interactive"):
            time.sleep(turn_s)
    chatting.clear()
    thread.join(10)
    during = [t for t in background_turns if t >= began]
    # One share of twenty turns' time is two turns (a few more slip in where the machine
    # is loaded); the rest of the gaps stay the chat's.
    assert len(during) <= 6, f"background took {len(during)} of the chat's {steps} gaps"
    device.check_integrity()


class SteppingClock:
    """A device clock that moves ``step`` seconds at every reading (set ``now`` to place
    it): a hold that lapses between two readings of one `acquire`."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now - self.step


def test_a_hold_that_lapses_while_a_background_waiter_looks_never_strands_it() -> None:
    """The device kept for interactive after its turn (a hold as long as that turn): a
    background waiter that found the hold still on, and whose next reading finds it over,
    takes the device then, without a release to wake it (once the user's turn has ended
    there is none: its model's requests would wait for ever)."""
    clock = SteppingClock(0.0)
    device = DeviceScheduler(clock=clock)
    with device.turn("chat", "interactive"):
        clock.now = 0.01
    # Released at 0.01 after 0.01 s: the hold lapses at 0.02. The waiter's first reading
    # (its grant) sees 0.015, inside the hold; the next sees 0.021, after it.
    clock.now, clock.step = 0.015, 0.006
    took = threading.Event()

    def background() -> None:
        with device.turn("embed", "background"):
            took.set()

    thread = threading.Thread(target=background, daemon=True)
    thread.start()
    assert took.wait(10), "the background waiter was stranded after the hold lapsed"
    thread.join(10)
    device.check_integrity()


def test_a_background_turn_is_budgeted_one_interactive_turn() -> None:
    clock = TurnClock()
    device = DeviceScheduler(clock=clock)
    assert device.turn_budget_s("background") is None  # no interactive turn yet
    with device.turn("chat", "interactive"):
        clock.spend(0.02)
    assert device.turn_budget_s("background") == pytest.approx(0.02, abs=1e-3)
    assert device.turn_budget_s("normal") == pytest.approx(0.02, abs=1e-3)
    assert device.turn_budget_s("interactive") is None
    # No step above background for a while (no turn of a user's under way): a background
    # turn may last up to idle_turn_s, no longer.
    clock.spend(IDLE_AFTER_S)
    assert device.turn_budget_s("background") == pytest.approx(device.idle_turn_s)
    with device.turn("chat", "interactive"):
        clock.spend(0.02)
    assert device.turn_budget_s("background") == pytest.approx(0.02, abs=1e-3)


def test_an_engines_start_probes_take_a_background_turn(tiny: ss.Model) -> None:
    """A model loaded into a running set measures its first and largest steps on the
    device: those steps wait for the turn another model's step holds, as its serving
    steps will, and take one background turn."""
    device = DeviceScheduler()
    device.acquire("chat", "interactive")  # another model's step holds the device
    started: list[tuple[float, ss.Engine]] = []

    def start() -> None:
        engine = ss.Engine(
            tiny, ss.EngineConfig(max_seqs=1, max_context=64), device=DeviceSeat(device, "new")
        )
        started.append((time.monotonic(), engine))

    thread = threading.Thread(target=start)
    thread.start()
    time.sleep(0.2)
    released = time.monotonic()
    device.release("chat")
    thread.join(60)
    ((finished, engine),) = started
    try:
        assert finished > released  # its probes waited for the turn
        assert device.counters.turns.get("new") == 1
        assert device.counters.turns_by_class["background"] == 1
        device.check_integrity()
    finally:
        engine.close()
