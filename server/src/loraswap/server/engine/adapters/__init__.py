"""Adapters, in three rooms by job, imported only downward: sources/ (where bytes come from) -> formats/ (what
they mean) -> residency/ (how they reach the weights). Each room's __init__ names what the rest of the engine
may use."""
