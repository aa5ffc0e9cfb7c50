"""Traces of what a server was asked (``format``) and their replay through kvtier's own eviction code
(``simulate``, ``kvtier simulate``: ``cli``)."""
