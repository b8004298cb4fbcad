"""Integrations with other systems: ``ray`` (data-parallel replicas on Ray Serve)."""
