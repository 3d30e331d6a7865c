"""The prefix family: a trace window replayed through cache-aware routing, by real processes
(``bench/bench_prefix.py``) and on a virtual clock (``bench/bench_kv_twin.py``).

- :mod:`~bench.prefix.window`: the window of a trace and the caches sized for it (both);
- :mod:`~bench.prefix.twin`: the virtual-clock replay through the frontend's routing core and
  the mockers' schedulers (``bench_kv_twin``).
"""

from typing import Final

#: The entry points this folder serves (``tests/test_layout.py`` holds them to it).
SCRIPTS: Final = ("bench_prefix", "bench_kv_twin")
