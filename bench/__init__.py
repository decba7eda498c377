"""Load generator and benchmarks (``llm-mesh bench``)."""
