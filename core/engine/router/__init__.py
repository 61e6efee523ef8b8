"""``engine serve --dp-size N``: N engine replicas (child ``engine serve`` processes) behind one
HTTP front that routes each request with a ``--router-policy`` (plugins of the
``register_routing_policies`` hook)."""
