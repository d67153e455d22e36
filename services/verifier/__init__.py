"""The verifier service: owns the target model, the paged KV cache and the step loop."""
