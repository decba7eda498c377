"""The mesh's local sidecar mode: identities, certificates and Envoy configurations
derived from mesh/consul (the intentions file is the one source of truth)."""
