"""The benchmark kit: what more than one benchmark of ``bench/`` needs, written once.

- :mod:`~bench.kit.processes`: child processes (start, ready line, CPU pinning, environment,
  stop) for a plain script (:func:`~bench.kit.processes.serve`), without Trio;
- :mod:`~bench.kit.children`: the same for a Trio benchmark (:class:`~bench.kit.children.Child`,
  ``async with``), commands on a child's standard input included;
- :mod:`~bench.kit.shim`: one of our workers with a frontend in front of it, connected, for
  the length of a block (and the two command lines);
- :mod:`~bench.kit.http`: the HTTP/1.1 client (h11 over Trio, keep-alive or one request), and
  blocking helpers for a plain script (``/health`` waits, a status awaited);
- :mod:`~bench.kit.metrics`: a ``/metrics`` page read as numbers;
- :mod:`~bench.kit.proc`: what ``/proc`` says of a process: CPU, run-queue wait, memory,
  descriptors, unread socket bytes;
- :mod:`~bench.kit.stats`: percentiles, medians, seeded Poisson arrivals;
- :mod:`~bench.kit.table`: the Markdown figure table;
- :mod:`~bench.kit.wrk`: wrk on the load CPU, its summary as figures;
- :mod:`~bench.kit.dynamo`: running NVIDIA Dynamo beside ours;
- :mod:`~bench.kit.fixed_engine`: an engine of fixed slots and service time
  (``--engine bench.kit.fixed_engine:create``).

The rules (checked by ``tests/test_layout.py``): a module at the top of ``bench/`` is a
benchmark's entry point and imports no other one; what two families of benchmarks share lives
here, and the kit imports nothing of ``bench/`` outside itself; a family's own pieces live in a
folder of its own, which names its entry points in ``SCRIPTS``.
"""
