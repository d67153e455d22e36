"""The drafter service: the DFlash model, its context cache, DDTree building, n-gram drafting."""
