"""The cluster: the one object that sends to the workers and hears from them (``Cluster``), its socket (the worker
link), the request groups it hands the edge, and the services that also speak to workers through it: which model
version serves a request, loading cold ones, fetching tokenizers, embeddings. It asks control and tenancy for
decisions and acts on them."""
