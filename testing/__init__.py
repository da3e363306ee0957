"""Helpers for tests and benchmarks: sample logs written through the real event types
(:mod:`aalis_agent.testing.sample`). Not used by the runtime itself."""
