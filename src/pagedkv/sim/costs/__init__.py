"""The other step costs: the roofline plus each framework's assumed block walk (``kernel.py``)
and a linear model fitted to the real engine's timed steps (``profiled.py``, ``profile_fit.py``)."""
