"""Tenancy: who sends a request and what share they get. Tenants and their API keys, rate limits, admission and
its fairness queues, service counters and slot shares, preemption for fairness, what several proxies share, and
the metering file."""
