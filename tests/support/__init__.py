"""Helpers the tests share: imported by the tests that use them, never from a conftest."""
