"""The fleet family: the real frontend following thousands of simulated workers
(``bench/bench_fleet.py``), and the two simulators it drives (``bench/fleet_sim.py``, real
workers in one Trio process; ``bench/lean_sim.py``, one cheap ``selectors`` loop).

- :mod:`~bench.fleet.model`: the simulated fleet both simulators run (protocols, limits, load);
- :mod:`~bench.fleet.control`: the benchmark's side of a simulator's control protocol;
- :mod:`~bench.fleet.figures`: one size's result, the frontend's event metrics, the table;
- :mod:`~bench.fleet.lean_frames`, :mod:`~bench.fleet.lean_workers`,
  :mod:`~bench.fleet.lean_planes`: the lean simulator's websocket frames, workers and planes.
"""

from typing import Final

#: The entry points this folder serves (``tests/test_layout.py`` holds them to it).
SCRIPTS: Final = ("bench_fleet", "fleet_sim", "lean_sim")
