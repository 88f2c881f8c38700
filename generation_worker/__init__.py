"""generation_worker."""
