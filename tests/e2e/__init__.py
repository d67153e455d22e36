"""End-to-end tests: the three services as real subprocesses."""
