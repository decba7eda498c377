"""Canary analysis: what a canary says against stable (drift), and how it serves (gates)."""
