"""The edge: what speaks to clients. HTTP (the OpenAI API, embeddings, admin, resumable streams), the WebSocket and
gRPC, request bodies and their validation, response bodies and streams, API keys, and conversations kept across
restarts. It hands a request to the cluster (``proxy.cluster``) and streams what comes back."""
