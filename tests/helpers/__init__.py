"""Shared test helpers: free ports, tiny model directories, processes, an engine double."""
