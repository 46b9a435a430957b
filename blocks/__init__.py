"""blocks package."""
