"""gpuledger up's restart delay (gpuledger/launcher.py Backoff): it grows only in a crash loop."""

from __future__ import annotations

from gpuledger.launcher import AT_ONCE_S, FIRST_DELAY_S, HEALTHY_AFTER_S, MAX_DELAY_S, QUICK_EXIT_S, Backoff


def test_a_crash_loop_doubles_the_delay_up_to_the_cap() -> None:
    b = Backoff()
    delays = [b.after_exit(0.1) for _ in range(12)]
    # the first quick exit may be a kill from outside: back at once; then the crash loop backs off
    assert delays[:5] == [AT_ONCE_S, FIRST_DELAY_S, 2 * FIRST_DELAY_S, 4 * FIRST_DELAY_S, 8 * FIRST_DELAY_S]
    assert delays[-1] == MAX_DELAY_S


def test_a_child_killed_after_a_real_run_comes_back_at_once_whatever_came_before() -> None:
    # The chaos bench: quick kills had built a streak, and a kill after 48 s of running then waited 8 s.
    b = Backoff()
    for _ in range(5):
        b.after_exit(1.0)
    assert b.after_exit(QUICK_EXIT_S + 1) == AT_ONCE_S
    assert b.after_exit(0.5) == FIRST_DELAY_S * 2 ** 4  # still a crash loop if it keeps dying at once
    assert b.after_exit(HEALTHY_AFTER_S) == AT_ONCE_S  # a healthy minute resets the streak
    assert b.after_exit(0.5) == AT_ONCE_S
    assert b.after_exit(0.5) == FIRST_DELAY_S
