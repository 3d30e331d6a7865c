"""The benchmarks: every module at the top of this folder is a command (``python bench/NAME.py``
or ``python -m bench.NAME``); what they share is the kit (:mod:`bench.kit`); a family's own pieces
are in a folder of its own (``fleet/``, ``slo/``, ``prefix/``, ``admission/``). The figures and
how to read them: ``docs/performance.md``.
"""
