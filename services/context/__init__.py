"""Context service: multi-turn session history per (tenant, session)."""
