"""Fixtures of the SDK acceptance tests: one real `tokenwire launch` (embedded tiny model, with
Envoy) shared by the Python and TypeScript SDK tests of a session."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.helpers.processes import Deployment, launch


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """`tokenwire launch --port P --http-port H` serving the embedded tiny model."""
    deployment = launch(tmp_path_factory.mktemp("sdk-launch"), http=True)
    try:
        yield deployment
    finally:
        if deployment.stop() not in (0, -signal.SIGTERM):
            print(deployment.log())
