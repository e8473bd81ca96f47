"""``tessera bench``: a load generator for any OpenAI-compatible server.

One load point, from flags to files:

    BenchConfig (config) -> workload specs (workloads) + arrival schedule (arrivals, tenants)
    -> run_point (runner): one streaming request per arrival (client), each filling a RequestRecord (records)
    -> summarize (metrics, tenants; the server's TTFT parts, ttft_parts) -> terminal table (summary_table),
       JSON (results), PNG (plots)

A sweep or a search for the highest rate that meets an SLO (sweep) runs
several points with the same workload and arrival seed. ``compare`` reads two
result files back. Metric names and definitions follow vLLM's
``vllm bench serve`` so that existing tooling reads the JSON.
"""
