"""How a multiplexed stream judges whether responses are worth holding for company."""

from __future__ import annotations

from llmmesh.runtime.multiplex import Arrivals


def test_frames_coming_apart_show_in_the_gap_and_close_ones_bring_it_down() -> None:
    arrivals = Arrivals()
    assert arrivals.gap_s == 0.0  # nothing yet: company is assumed near
    for n in range(30):  # one stream on an engine at 3 ms a token
        arrivals.note(100.0 + 0.003 * n)
    assert 0.0025 < arrivals.gap_s <= 0.003  # past a 2 ms hold: nothing waits
    for n in range(30):  # sixteen streams: a step's frames 0.1 ms apart
        arrivals.note(100.2 + 0.0001 * n)
    assert arrivals.gap_s < 0.0005  # well under the hold: later frames wait for company
