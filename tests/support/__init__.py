"""Helpers shared by the tests (processes, environments); no tests here. ``tests/conftest.py`` puts ``tests/`` on
``sys.path``, so any test imports them as ``from support.<module> import ...``."""
