"""The endpoint picker: chooses the replica for each request behind Envoy (GIE's ext_proc protocol)."""
