"""The configuration: ``schema`` (the sections and choices), ``loading`` (load, dump) and ``checks`` (validate);
``keys`` (every key's type, default and meaning, and the commented YAML that ``ignite-mgpu config`` prints).
Imports nothing: import the module you need."""
