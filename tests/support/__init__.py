"""Helpers shared by the tests (processes, environments); no tests here."""
