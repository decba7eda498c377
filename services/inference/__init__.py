"""Inference service: one per Triton replica; streams generations from Triton."""
