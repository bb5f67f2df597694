"""The vLLM-class reference clock: a GPU's ops priced one by one from a few numbers fitted to
measured kernel times (Vidur's profiles): the clock, its data, its fit, and a step's cost on it."""
