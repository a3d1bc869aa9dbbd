"""plandsl: a declarative language for distributed deep-learning training plans.

The library API is `plandsl.api` (one function per stage); the command line is `plandsl`.
"""
__version__ = "0.1.0"
