"""The core: requests, workers and routing. A request's choices and their state machine, the registry of workers
and their latency capacity, the routing policies, and what every room uses: errors and metrics."""
