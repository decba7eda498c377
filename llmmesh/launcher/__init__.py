"""Runs the local stack as supervised processes (``llm-mesh up``)."""

from llmmesh.launcher.stack import Stack, StackPorts

__all__ = ["Stack", "StackPorts"]
