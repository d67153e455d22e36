"""The verifier's engine: scheduler, step loop, speculative plan, adaptive policy, cost model."""
