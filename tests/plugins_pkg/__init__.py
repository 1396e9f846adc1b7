"""Factories of a "user's package" for the plug-in tests (tests/train/test_plugins.py,
tests/train/data/test_datasets.py,
test_cli.py): named in configs as ``tests.plugins_pkg.factories:<name>``."""
