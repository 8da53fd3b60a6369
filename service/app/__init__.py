"""Processes and commands: the `tokenwire` CLI, router assembly and draining, the multi-process
router, the launcher and the Envoy gateway runner."""
