"""Logs and Prometheus metrics of the router."""
