"""One engine step: the loop over its phases (``loop.py``), the draws and the sampler, logit
processing, containment of failures, the step timeline, the requests' side (``record.py``) and
the stats sampled after every step (``stats_recorder.py``)."""
