"""llm-mesh: a gRPC service mesh that serves LLMs on NVIDIA Triton Inference Server."""

__version__ = "0.1.0"
