"""Builders and statistics shared by the test modules, one module per kind of help:

- `helpers.models`: tiny random models built in code (CPU and CUDA), HF greedy references, per-row trees, the
  bench's token count;
- `helpers.stats`: analytic joints of toy models and goodness-of-fit statistics (the exactness tests);
- `helpers.runs`: tiny training runs, teacher data, configs, run comparisons, launchers, offline W&B runs;
- `helpers.reports`: a synthetic eval report; a promotable EAGLE-3 run (target folder, head, report);
- `helpers.syncs`: host syncs (reads back, copies from host data) counted on the CPU, for the CUDA path's invariants.

Test modules import from these (`from helpers.models import tiny_llama`), never from each other or from conftest.py
(which holds fixtures and hooks only). pytest's default import mode puts tests/ on sys.path; a subprocess script
inserts `TESTS` (helpers.runs) itself.
"""
