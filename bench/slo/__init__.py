"""The SLO family: goodput at a TTFT objective, fixed N against the adaptive limit
(``bench/bench_slo.py``), and the load generator of its end-to-end mode (``bench/slo_e2e.py``).

- :mod:`~bench.slo.figures`: the workloads, the configurations, a row's summary, the verdict
  and the table, without I/O;
- :mod:`~bench.slo.e2e`: the end-to-end mode's run: a worker and a frontend, the load
  generator's process against them, and the refusals both counted.
"""

from typing import Final

#: The entry points this folder serves (``tests/test_layout.py`` holds them to it).
SCRIPTS: Final = ("bench_slo", "slo_e2e")
