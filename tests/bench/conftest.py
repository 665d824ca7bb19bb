"""Fixtures of the bench tests: one scripted OpenAI-compatible server for the whole folder."""

import pytest
from benchkit import ScriptedServer


@pytest.fixture(scope="session")
def server():
    s = ScriptedServer()
    yield s
    s.stop()
