"""Fixtures shared by the whole suite live in tests/fixtures/; each area may add its own conftest.py."""

pytest_plugins = [
    "tests.fixtures.servers",
    "tests.cluster.fixture",
    "tests.images.registry",
]
