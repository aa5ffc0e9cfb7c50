"""The server's admin plane: the admin HTTP port (``http.py``: health, status, metrics, clear; the management API's
routes, ``manage_http.py``, over its operations, ``manage.py``), who may use it (``access.py``), the Prometheus
exposition (``telemetry.py``) and ``kvtier cache`` (``cache_cli.py``). It reads the server through
``KVTierServer.status_snapshot`` and ``health`` and acts through ``clear`` and the management API's parts."""
