"""Sweeps over the simulator that reproduce the articles' and papers' experiments.

Each experiment is a module with ``run(...)`` (every point, as JSON-ready data) and a figure
writer; ``runner.run_points`` spreads a sweep's independent points over the machine's cores.
"""
