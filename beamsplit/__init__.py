"""beamsplit."""
