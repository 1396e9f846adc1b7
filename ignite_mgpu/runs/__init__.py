"""Run folders, torch-free: their file names (``folder``), reading them back (``read``), the text table and JSON of
``ignite-mgpu report`` (``table``), its figure (``figure``, matplotlib only when drawing). Imports nothing."""
