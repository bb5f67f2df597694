"""The pagedkv-triton clock: pagedkv's own engine on a GPU, fitted to its device check: the clock,
its decode law, its fit and calibration, the check's data, and the check that replays its runs."""
