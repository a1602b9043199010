"""Families written outside memviz against its public family API (`memviz.register_family`),
found through the `memviz.families` entry point like a user's own package would be."""
