"""`splitserve bench`: the load generator, an OpenAI-API client that measures any server.

It sits beside the benchmark scripts of bench/ (which run it against splitserve and a peer) and
ships in the package so users can measure their own deployments. It is a client, so it knows
the server only through the HTTP API: torch-free, and importing nothing of ours beyond
platform's errors and tokenizer (tests/layering.py). Nothing that serves imports it; the
`splitserve bench` command reaches it through its console entry point. docs/bench.md.
"""
