"""Load tests and benchmarks for transformers-openai-api: one CLI (`loadtest`), one way to start a server."""
