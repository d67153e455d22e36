"""The gateway service: tokenize, forward to the verifier, detokenize, stop strings, per-request
stats. Entry point: `python -m services.gateway` (or `specserve serve gateway`)."""
