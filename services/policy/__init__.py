"""Policy service: rules on prompts (and, later, on streamed output)."""
