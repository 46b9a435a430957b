"""The multi-host test bench: hosts as Linux network namespaces on one bridge (DESIGN.md §5)."""
