"""The admission family: what the worker's gate costs (``bench/bench_admission.py``) and what
its classes do under overload (``bench/bench_classes.py``).

- :mod:`~bench.admission.loops`: the gate timed alone, in one task (both).
"""

from typing import Final

#: The entry points this folder serves (``tests/test_layout.py`` holds them to it).
SCRIPTS: Final = ("bench_admission", "bench_classes")
