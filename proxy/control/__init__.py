"""Control: capacity and latency targets. The limits admission asks (decode slots, room to prefill), the TTFT target
and early rejection, the prefill gate, and the adaptive controller. Each returns a decision; the cluster acts."""
