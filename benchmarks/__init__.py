"""ignite-mgpu's benchmarks, one folder per concern (the map: benchmarks/README.md). A package so that scripts share
helpers as ``benchmarks.<folder>.<module>``, imported from the repository root; not installed (setup.cfg ships
ignite_mgpu only)."""
