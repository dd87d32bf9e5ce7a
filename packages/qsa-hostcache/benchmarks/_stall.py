"""What a call costs the rest of its process: its seconds, and the longest a second thread waited.

The second thread wakes every :data:`TICK_S` seconds; the longest gap between its wake-ups is how
long a scheduler thread of the same process would have waited on the call (a call that holds the
GIL stalls it). Shared by the shared-tier benchmarks of this folder.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: How often the second thread wakes, in seconds.
TICK_S = 0.001


def timed(call: Callable[[], object]) -> tuple[float, float, object]:
    """Seconds ``call`` took, the longest wait of a thread waking every :data:`TICK_S`
    meanwhile (seconds), and what ``call`` returned."""
    stop = threading.Event()
    longest = [0.0]

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            longest[0] = max(longest[0], now - last)
            last = now
            time.sleep(TICK_S)

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.05)
    began = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - began
    stop.set()
    thread.join()
    return seconds, longest[0], result
