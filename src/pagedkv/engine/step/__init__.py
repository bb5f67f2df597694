"""One engine step: the loop over its phases (``loop.py``), the draws and the sampler, logit
processing, containment of failures, the step timeline, and the requests' side (``record.py``)."""
