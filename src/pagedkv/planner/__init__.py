"""The block-size planner: the four ledgers, W(B), backend constraints, the plan and its report.

Pure Python (never imports torch). Modules: ``ledgers`` (the article's four ledgers and W(B)),
``workload`` (parameters, or a trace read by ``pagedkv.traces``), ``constraints`` (the kernel
rules table and block-size resolution), ``plan``, ``report``, ``plot``. The KV layout, model
shapes and the page format it plans over live in ``pagedkv.pages``.
"""
