"""Helpers shared by tests (checkpoint builders); not part of any package's API."""
