"""The router's network faces: the app factory and lifespan, the state the proxy and the admin
API share, the proxy hot path, the admin API, upstream connections, the ``/metrics`` scraper of
replicas, the router's own Prometheus metrics and the ``kvrouter serve`` command."""
