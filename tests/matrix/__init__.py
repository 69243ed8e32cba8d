"""The configuration matrix of fp16kit's optimizers (docs/guarantees.md, "The configuration matrix").

``axes.py`` holds the one table of axes and the per-entry rules (what each optimizer supports, what it refuses and
with which error, the known defects); ``harness.py`` builds and steps one cell and holds the oracles;
``test_matrix.py`` generates the cells and runs them (a seeded sample by default, every cell under ``-m slow``).
"""
