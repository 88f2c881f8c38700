"""context_worker."""
