"""The configuration: ``schema`` (the sections and choices), ``loading`` (load, dump) and ``checks`` (validate).
Imports nothing: import the module you need."""
