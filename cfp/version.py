"""cfp's version, at the floor so any pass may read it (the profile cache key holds it)."""
__version__ = "0.1.0"
