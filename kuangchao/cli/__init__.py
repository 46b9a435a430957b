"""The ``kc`` command line."""
