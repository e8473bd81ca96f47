"""The gRPC API: ``tessera.proto``, its generated modules, and the servicers (``service.py``)."""
