"""Model helpers: tiny offline models for tests, examples and benchmarks."""
