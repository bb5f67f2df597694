"""The block-size planner: KV record layout, the four ledgers, W(B), backend constraints.

Pure Python (never imports torch). Modules: ``layout`` (record bytes, presets), ``kv_dtypes``,
``ledgers`` (the article's four ledgers and W(B)), ``workload`` (parameters, or a trace read by ``pagedkv.traces``),
``constraints`` (backends, block-size resolution, page-format fingerprint), ``report``.
"""
