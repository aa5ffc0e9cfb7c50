"""Makes ``tests/`` importable (pytest's default "prepend" import mode puts a rootless conftest's folder on
``sys.path``), so every test reaches the helpers in ``tests/support/`` as ``support.<module>``."""
