"""The HTTP router (``pagedkv route``): sends each request to the replica that holds its
prefix. The decisions live in ``pagedkv.routing`` (pure Python, shared with the simulator);
this package is the edge around them:

``config`` (``RouterConfig``), ``handshake`` (the replicas' ``/pagedkv/info`` and the rule for
which may share a router), ``event_reader`` (one replica's KV event stream from Redis),
``replicas`` (their state, the shared prefix index, the chooser), ``health`` (the health loop),
``edge`` (serve's parsing and 400s, the request's block hashes), ``forward`` (retries, the
stream relay), ``metrics``, ``app`` (the FastAPI app) and ``server`` (start-up). Guide:
docs/routing.md.
"""
