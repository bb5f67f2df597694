"""pagedkv on Ray Serve: engine replicas as a Serve application whose request router is
pagedkv's prefix-aware policy (``pagedkv serve --replicas N``, or a Serve config naming
``pagedkv.commands.serve_app:app``). Guide: docs/ray_serve.md.

Ray is an optional dependency (``pip install 'pagedkv[ray]'``): only ``request_router``,
``app``, ``launch`` and the replicas import it, and only when used. ``stats``, ``ranking``,
``call`` and ``config`` import neither ray nor torch.
"""
